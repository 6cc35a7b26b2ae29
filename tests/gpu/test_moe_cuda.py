"""The grouped experts on CUDA (torch._grouped_mm, LoRA through grouped GEMMs) against the
float64 loop on fresh random inputs: output and the gradients of the rows, the expert weights
and the LoRA factors, with empty experts and odd row counts, bf16 (tolerance 1e-2); and the
dispatch back to the loop where grouped GEMMs do not apply (LoRA rank 4). With frozen expert
weights the grouped path is one autograd Function (kept whole by Swap Core's ``experts``): bit for
bit autograd's composition of the same grouped GEMMs. Both with K3's SiTU (autograd composes it)
and with SwiGLU (the fused kernel, kiln_kernels.moe.triton.swiglu_rows). Each row weighed by a
routing weight (fp32, as the router gives it), whose gradient is checked too."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.moe import grouped_mlp, reference
from tests.tolerance import rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def situ(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * (25 * torch.tanh(u / 25))


def case(E: int, D: int, I: int, r: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.randint(0, 60, (E,), device="cuda", generator=g)
    counts[1] = 0  # an expert without rows
    M = int(counts.sum())
    t = lambda *s, sc=1.0: (torch.randn(*s, device="cuda", generator=g) * sc).requires_grad_()
    x = t(M, D)
    W1, W2 = t(E, 2 * I, D, sc=D**-0.5), t(E, D, I, sc=I**-0.5)
    lora = {
        "gate_up_proj": (t(E, r, D, sc=D**-0.5), t(E, 2 * I, r, sc=0.1)),
        "down_proj": (t(E, r, I, sc=I**-0.5), t(E, D, r, sc=0.1)),
    }
    w = torch.rand(M, device="cuda", generator=g).requires_grad_()
    return x, counts, W1, W2, lora, w


def leaves(x, W1, W2, lora, w):
    return [x, W1, W2, *[p for pair in lora.values() for p in pair], w]


ACTS = [situ, reference.swiglu]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("E,D,I,r", [(8, 64, 32, 8), (13, 256, 96, 16)])
def test_grouped_matches_the_loop(E, D, I, r, act):
    x, counts, W1, W2, lora, w = case(E, D, I, r, E + D)
    dy = torch.randn(x.shape[0], D, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = grouped_mlp(x, counts, W1, W2, act, lora, 2.0, w)
    assert y.dtype == torch.bfloat16  # as F.linear under autocast
    y.float().backward(dy)
    got = [p.grad for p in leaves(x, W1, W2, lora, w)]
    d = [p.detach().double().requires_grad_() for p in leaves(x, W1, W2, lora, w)]
    d_lora = {"gate_up_proj": (d[3], d[4]), "down_proj": (d[5], d[6])}
    want = reference.grouped_mlp(d[0], counts, d[1], d[2], act, d_lora, 2.0, d[7])
    want.backward(dy.double())
    assert rel(y, want) < 1e-2
    for i, (a, b) in enumerate(zip(got, d, strict=True)):
        assert rel(a, b.grad) < 1e-2, i


def test_rank_4_falls_back_to_the_loop():
    from kiln_kernels.moe import grouped

    x, counts, W1, W2, lora, _ = case(4, 64, 32, 4, 7)
    assert not grouped.usable(x, W1, W2, lora)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = grouped_mlp(x, counts, W1, W2, situ, lora, 2.0)
        z = reference.grouped_mlp(x, counts, W1, W2, situ, lora, 2.0)
    assert torch.equal(y, z)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("lora_on", [("gate_up_proj", "down_proj"), ("gate_up_proj",), ("down_proj",), ()])
def test_frozen_experts_are_autograds_composition_bit_for_bit(lora_on, act):
    from kiln_kernels.moe import grouped

    x, counts, W1, W2, lora, w = case(13, 256, 96, 16, 5)
    W1, W2 = W1.detach().bfloat16(), W2.detach().bfloat16()  # frozen, stored bf16 as the trainer does
    lora = {k: v for k, v in lora.items() if k in lora_on}
    trained = [x, *[p for pair in lora.values() for p in pair], w]
    dy = torch.randn(x.shape[0], 256, device="cuda")
    out = []
    for fn in (grouped_mlp, lambda *a: grouped.mlp(grouped.gmm, *a[:-1], w_M=a[-1])):
        for p in trained:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, counts, W1, W2, act, lora, 2.0, w)
        y.float().backward(dy)
        out.append([y.detach(), *(p.grad for p in trained)])
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))
    d = [t.detach().double().requires_grad_() for t in trained]
    want = reference.grouped_mlp(
        d[0],
        counts,
        W1.double(),
        W2.double(),
        act,
        {k: (d[1 + 2 * i], d[2 + 2 * i]) for i, k in enumerate(lora)},
        2.0,
        d[-1],
    )
    want.backward(dy.double())
    assert rel(out[0][0], want) < 1e-2
    for i, (a, b) in enumerate(zip(out[0][1:], d, strict=True)):
        assert rel(a, b.grad) < 1e-2, i
