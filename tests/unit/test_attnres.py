"""Attention Residuals: the depth softmax, its gradients, and the block bookkeeping."""

from __future__ import annotations

import torch

from engine.model.common.attnres import AttnResQueries, Residuals
from kiln_kernels.attnres import depth_attention


def test_depth_attention_is_a_softmax_over_rms_normalised_sources():
    g = torch.Generator().manual_seed(0)
    v = (
        torch.randn(5, 2, 7, 16, generator=g, dtype=torch.float64)
        * torch.rand(5, 1, 1, 1, generator=g, dtype=torch.float64)
        * 3
    )
    w = torch.randn(16, generator=g, dtype=torch.float64)
    out = depth_attention(v, w)
    for b in range(2):
        for t in range(7):
            keys = torch.stack([x / torch.sqrt((x * x).mean() + 1e-6) for x in v[:, b, t]])
            alpha = torch.softmax(keys @ w, 0)
            assert torch.allclose(out[b, t], (alpha[:, None] * v[:, b, t]).sum(0), atol=1e-12)
    assert torch.allclose(depth_attention(v, torch.zeros(16, dtype=torch.float64)), v.mean(0), atol=1e-12)
    # the keys are scale-free: scaling a source changes its value, not its weight
    scaled = v.clone()
    scaled[2] *= 10
    alpha_w = lambda s: torch.softmax(
        torch.einsum("lbtd,d->lbt", s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), w), 0
    )
    assert torch.allclose(alpha_w(v), alpha_w(scaled), atol=1e-6)


def test_depth_attention_gradients():
    v = torch.randn(3, 1, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(depth_attention, (v, w))


def test_fp32_math_for_bf16_sources():
    v = torch.randn(4, 1, 3, 8, dtype=torch.bfloat16)
    w = torch.randn(8)
    out = depth_attention(v, w)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), depth_attention(v.double(), w.double()).float(), atol=1e-2)


def test_blocks_sum_inside_and_attend_across():
    emb = torch.randn(1, 2, 4, dtype=torch.float64)
    outs = [torch.randn(1, 2, 4, dtype=torch.float64) for _ in range(5)]
    plain = Residuals(emb, None, block_size=2)
    for o in outs:
        plain.add(o)
    assert torch.allclose(plain.input(0), emb + sum(outs))  # off: the ordinary residual stream
    q = AttnResQueries(sites=3, hidden=4).double()
    r = Residuals(emb, q, block_size=2)
    assert torch.equal(r.input(0), emb)  # one source: itself
    for o in outs:
        r.add(o)
    assert len(r.blocks) == 3 and torch.allclose(r.blocks[1], outs[0] + outs[1]) and torch.allclose(r.partial, outs[4])
    # zero queries: the mean of [embedding, block 1, block 2, partial]
    want = (emb + outs[0] + outs[1] + outs[2] + outs[3] + outs[4]) / 4
    assert torch.allclose(r.input(1), want)
