"""Swap Core's ``kernels`` op class on the Triton kernels themselves: a block that feeds KDA, or
DSA's sparse attention and indexer loss, from trainable projections is recomputed in the
backward; with the kernels' outputs kept, their forward kernels run once (as without recompute,
twice under full recompute) and every gradient is bit-equal to the run without recompute. On a
CPU these run through Triton's interpreter in fp32 (tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.memory import SwapCore
from kiln.spec import MemorySpec
from tests.interpret import DEVICE, needs_kernels

pytestmark = needs_kernels
SPECS = {
    "none": MemorySpec(),
    "full": MemorySpec(recompute="full"),
    "kept": MemorySpec(recompute="selective", cache_ops=["kernels"]),
    "kept, host": MemorySpec(recompute="selective", cache_ops=["kernels"], tier="host"),
}


class Launches:
    """A Triton kernel whose launches are counted."""

    def __init__(self, jit):
        self.jit, self.n = jit, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.jit[grid]


class KDABlock(nn.Module):
    def __init__(self, D=24, H=2, K=16, V=16):
        super().__init__()
        self.H, self.K, self.V = H, K, V
        self.qkv = nn.Linear(D, H * (2 * K + V))
        self.gate, self.beta, self.out = nn.Linear(D, H * K), nn.Linear(D, H), nn.Linear(H * V, D)

    def forward(self, x):
        from kiln_kernels.kda import triton as fast

        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, self.H, -1).split([self.K, self.K, self.V], -1)
        g = -F.softplus(self.gate(x)).view(B, T, self.H, self.K)
        o, _ = fast.kda_chunk(
            F.normalize(q, dim=-1),
            F.normalize(k, dim=-1),
            v,
            g,
            torch.sigmoid(self.beta(x)),
            cu_seqlens=torch.tensor([0, 30, 70], device=x.device),
        )
        return self.out(o.reshape(B, T, -1)), None


class DSABlock(nn.Module):
    def __init__(self, D=24, H=4, E=16, J=2, DH=16, topk=8):
        super().__init__()
        self.H, self.E, self.J, self.DH, self.topk = H, E, J, DH, topk
        self.q, self.kv = nn.Linear(D, H * E), nn.Linear(D, 2 * E)
        self.iq, self.ik, self.iw = nn.Linear(D, J * DH), nn.Linear(D, DH), nn.Linear(D, J)
        self.out = nn.Linear(H * E, D)

    def forward(self, x):
        from kiln_kernels import dsa
        from kiln_kernels.dsa import triton as fast

        B, T, _ = x.shape
        iq, ik, iw = self.iq(x).view(B, T, self.J, self.DH), self.ik(x), self.iw(x)
        starts = torch.zeros(B, T, dtype=torch.long, device=x.device)
        idx = dsa.indexer_topk(iq.detach(), ik.detach(), iw.detach(), starts, self.topk)  # a selection: kept
        k, v = self.kv(x).view(B, T, 1, 2 * self.E).chunk(2, -1)
        q = self.q(x).view(B, T, self.H, self.E)
        o, loss = fast.sparse_attention(q, k, v, idx, self.E**-0.5, (iq, ik, iw))  # the loss: from the backward
        return self.out(o.reshape(B, T, -1)), loss


def run(block_type, spec: MemorySpec) -> dict:
    torch.manual_seed(0)
    block = block_type().to(DEVICE).train()
    SwapCore(spec).wrap(block) if spec.recompute != "none" else None
    x = torch.randn(1, 70, 24, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1), requires_grad=True)
    y, side = block(x)
    loss = (y * torch.linspace(-1, 1, y.shape[-1], device=DEVICE)).sum() + (side if side is not None else 0)
    loss.backward()
    return {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}


@pytest.fixture
def deterministic():
    """DSA's backward sums its keys' gradients in a fixed order only under deterministic
    algorithms (with atomics otherwise, and two runs differ)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("block_type,kernels", [(KDABlock, ["_output"]), (DSABlock, ["_attn_fwd"])])
def test_kept_kernels_run_once_and_the_gradients_are_bit_equal(block_type, kernels, deterministic, monkeypatch):
    from kiln_kernels.dsa import triton as dsa_kernels
    from kiln_kernels.kda import triton as kda_kernels

    module = kda_kernels if block_type is KDABlock else dsa_kernels
    got, launches = {}, {}
    for name, spec in SPECS.items():
        counted = {k: Launches(getattr(module, k)) for k in kernels}
        for k, c in counted.items():
            monkeypatch.setattr(module, k, c)
        got[name] = run(block_type, spec)
        launches[name] = {k: c.n for k, c in counted.items()}
        for k, c in counted.items():
            monkeypatch.setattr(module, k, c.jit)
    for k in kernels:
        assert launches["none"][k] == launches["kept"][k] == launches["kept, host"][k] == 1, (k, launches)
        assert launches["full"][k] == 2, (k, launches)
    ref = got["none"]
    for name in ("full", "kept", "kept, host"):
        assert got[name].keys() == ref.keys()
        for n in ref:
            assert ref[n] is not None and ref[n].abs().sum() > 0, n
            assert torch.equal(got[name][n], ref[n]), (name, n)
