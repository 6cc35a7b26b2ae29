"""LoRA merge/unmerge in place, its output dtype under autocast, the aux-loss-free router
balancing, the experts' row counts, and the experts' reference on a decode step's few rows."""

from __future__ import annotations

import pytest
import torch

from engine.lora import LoRALinear, apply_lora, merge, unmerge
from engine.model.common.moe import Router, counts_of
from engine.model.kimi_linear import KimiLinearForCausalLM, init_kimi_linear, kimi_linear_tiny_config
from kiln.spec import LoraSpec
from tests.tolerance import rel


def kimi(seed=0):
    m = KimiLinearForCausalLM(kimi_linear_tiny_config()).double()
    init_kimi_linear(m, seed)
    return m.double().eval()


def test_merge_then_unmerge_in_place():
    model = kimi()
    apply_lora(
        model,
        LoraSpec(
            rank=4,
            target_modules=["q_proj", "o_proj", "down_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 263, (2, 30), generator=torch.Generator().manual_seed(1))
    base = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        with_lora = model(ids)
        merge(model)
        merged = model(ids)
        unmerge(model)
        after = model(ids)
    assert float((merged - with_lora).norm() / with_lora.norm()) < 1e-12
    assert float((after - with_lora).norm() / with_lora.norm()) < 1e-12
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.data_ptr() == ptrs[n] and torch.allclose(p, base[n], atol=1e-14, rtol=0)  # never copied


def test_lora_keeps_the_output_dtype_of_the_layer_it_wraps():
    """Under bf16 autocast a linear layer fed fp32 (an RMSNorm with fp32 weights gives fp32) returns
    bf16; wrapped in LoRA it must too. It returned fp32, and the model sent fp32 to its attention
    kernels (IEEE fp32 dots: DSA's attention took ~10x as long on the H200)."""
    torch.manual_seed(0)  # (unseeded, it failed after other tests' draws: one element past 2e-2)
    layer = LoRALinear(torch.nn.Linear(32, 48, bias=False), rank=4, alpha=8, dropout=0.0)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, plain = layer(x), layer.base(x)
    assert got.dtype == plain.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        want = layer(x)  # fp32 throughout
    assert want.dtype == torch.float32 and not torch.equal(want, layer.base(x))  # the LoRA term counts
    assert rel(got, want) < 1e-2  # bf16's rounding, as a whole (single elements near 0 can exceed it)


def test_bias_balancing_evens_out_expert_load():
    model = kimi(3).float().train()
    router = next(m for m in model.modules() if isinstance(m, Router))
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 is everyone's favourite
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(0))

    def spread():
        router.load = None
        router(x)
        load = router.load.float()
        return float(load.max() - load.min()), load

    first, _ = spread()
    router.load = None
    for _ in range(200):
        router(x)
        router.update_bias(1e-2)
    last, load = spread()
    assert last < first / 2, (first, last, load)
    assert abs(float(router.e_score_correction_bias.mean())) < 1e-6  # mean-free updates


def test_the_router_chooses_in_fp32_under_autocast():
    """Under bf16 autocast the router's scores stay fp32: the same experts and weights as without
    it, where bf16 scores would tie and reorder close experts."""
    torch.manual_seed(0)
    router = Router(64, 32, 4)
    with torch.no_grad():
        router.weight.normal_(0, 0.02)
    x = torch.randn(50, 64)
    idx, w = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx2, w2 = router(x)
    assert w2.dtype == torch.float32 and torch.equal(idx2, idx) and torch.equal(w2, w)


@pytest.mark.parametrize("n,size", [(8, 1000), (64, 37), (5, 0)])
def test_counts_of_sorted_ids_is_bincount(n, size):
    """The experts' row counts without bincount's host sync: the same counts, absent ids 0."""
    ids = torch.randint(0, n - 1, (size,), generator=torch.Generator().manual_seed(size))  # id n-1 never drawn
    got = counts_of(ids.sort()[0], n)
    assert got.dtype == torch.int64 and torch.equal(got, torch.bincount(ids, minlength=n)) and got[-1] == 0


@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_a_decode_steps_tokens_meet_every_expert_as_the_sorted_path_sums_them(act):
    """``every_expert`` (each expert on every token, weighed by the token's routing weight there,
    0 where it did not choose it) equals the sort, the loop over the experts and the sum back
    into the tokens, float64, LoRA on both projections, an expert no token chose; and the MoE
    layer takes it for a decode step's few tokens without autograd, not with autograd or when
    experts outnumber the (token, expert) pairs."""
    from engine.model.common import moe
    from engine.model.common.moe import ACTIVATIONS, Experts
    from kiln_kernels.moe import reference

    g = torch.Generator().manual_seed(7)
    E, D, I, r, N, k = 6, 12, 10, 3, 4, 2
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 3], [3, 4], [5, 0], [3, 2]])  # expert 1 chosen by none
    x, w = t(N, D), torch.rand(N, k, generator=g, dtype=torch.float64)
    ex = Experts(E, D, I, act).double()
    with torch.no_grad():
        ex.gate_up_proj.copy_(t(E, 2 * I, D))
        ex.down_proj.copy_(t(E, D, I))

    lora = {"gate_up_proj": (t(E, r, D), t(E, 2 * I, r)), "down_proj": (t(E, r, I), t(E, D, r))}
    got = reference.every_expert(x, idx, w, ex.gate_up_proj, ex.down_proj, ACTIVATIONS[act], lora, 0.5)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    y = reference.per_expert(
        x[order // k], counts, ex.gate_up_proj, ex.down_proj, ACTIVATIONS[act], lora, 0.5, w.reshape(-1)[order]
    )
    want = torch.zeros_like(x).index_add_(0, order // k, y)
    assert rel(got, want) < 1e-12 and want.abs().sum() > 0

    calls = []
    real = moe.every_expert
    moe.every_expert = lambda *a: calls.append(1) or real(*a)
    try:
        ex.lora = type("L", (), {"scaling": 0.5, "factors": lambda self: lora})()
        with torch.no_grad():
            assert rel(ex(x, idx, w), want) < 1e-12 and len(calls) == 1
        assert rel(ex(x, idx, w), want) < 1e-12 and len(calls) == 1  # autograd: the sorted path
        with torch.no_grad():
            ex(x[:2], idx[:2], w[:2])  # 6 experts, 4 pairs: the sorted path
        assert len(calls) == 1
    finally:
        moe.every_expert = real


@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_few_rows_run_row_by_row_as_the_loop_runs_them(act):
    """kiln_kernels.moe.reference on a decode step's rows (``per_row``: each row's expert's weights
    gathered) equals the loop over the experts (``per_expert``), float64, forward and every
    gradient: rows, weights, LoRA factors on both projections, routing weights; an expert
    without rows, one with several; and ``grouped_mlp`` takes it for few rows without autograd."""
    from engine.model.common.moe import ACTIVATIONS
    from kiln_kernels.moe import reference

    g = torch.Generator().manual_seed(5)
    E, D, I, r = 6, 12, 10, 3
    counts = torch.tensor([2, 0, 1, 4, 1, 1])
    M = int(counts.sum())
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
    leaves = [t(M, D), t(E, 2 * I, D), t(E, D, I), t(E, r, D), t(E, 2 * I, r), t(E, r, I), t(E, D, r)]
    leaves.append(torch.rand(M, generator=g, dtype=torch.float64).requires_grad_())
    dy = torch.randn(M, D, generator=g, dtype=torch.float64)

    def run(fn):
        for p in leaves:
            p.grad = None
        x, W1, W2, A1, B1, A2, B2, w = leaves
        y = fn(x, counts, W1, W2, ACTIVATIONS[act], {"gate_up_proj": (A1, B1), "down_proj": (A2, B2)}, 0.5, w)
        y.backward(dy)
        return [y.detach(), *(p.grad for p in leaves)]

    got, want = run(reference.per_row), run(reference.per_expert)
    assert all(rel(a, b) < 1e-12 for a, b in zip(got, want, strict=True))
    assert all(b.abs().sum() > 0 for b in want)
    with torch.no_grad():  # a decode step's: few rows, no autograd
        args = (leaves[0], counts, leaves[1], leaves[2], ACTIVATIONS[act])
        lora = {"gate_up_proj": (leaves[3], leaves[4]), "down_proj": (leaves[5], leaves[6])}
        assert torch.equal(reference.grouped_mlp(*args, lora, 0.5, leaves[7]), got[0])
