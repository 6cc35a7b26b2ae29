"""The Triton depth attention (AttnRes) against the float64 definition on fresh random inputs:
the output and the gradients of the sources and the pseudo-query, odd shapes, bf16 and fp32
(ARCHITECTURE.md's tolerances); and the dispatch. On a CPU the small fp32 cases run through
Triton's interpreter (tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.attnres.reference import depth_attention as definition
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "L,B,T,D",
    [
        (1, 1, 5, 64),
        (3, 2, 37, 96),
        pytest.param(9, 1, 513, 7168, marks=gpu_only),
        pytest.param(14, 3, 11, 4096, marks=gpu_only),
    ],
)
def test_matches_the_definition(L, B, T, D, dtype):
    from kiln_kernels.attnres.triton import depth_attention

    g = torch.Generator(device=DEVICE).manual_seed(L * 1000 + D)
    scale = torch.rand(L, 1, 1, 1, device=DEVICE, generator=g) * 3 + 0.1  # sources of different sizes
    v = (torch.randn(L, B, T, D, device=DEVICE, generator=g) * scale).to(dtype).requires_grad_()
    w = (torch.randn(D, device=DEVICE, generator=g) * 0.3).requires_grad_()  # fp32, as the model keeps it
    dh = torch.randn(B, T, D, device=DEVICE, generator=g).to(dtype)
    out = depth_attention(v, w)
    out.backward(dh)
    v64, w64 = v.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = definition(v64, w64)
    want.backward(dh.double())
    assert out.dtype == dtype and out.shape == (B, T, D)
    assert rel(out, want) < TOL[dtype]
    assert rel(v.grad, v64.grad) < TOL[dtype] and rel(w.grad, w64.grad) < TOL[dtype]


@gpu_only
def test_dispatch(monkeypatch):
    import kiln_kernels.attnres as attnres

    v = torch.randn(4, 2, 9, 128, device=DEVICE)
    w = torch.randn(128, device=DEVICE)
    fast = attnres.depth_attention(v, w)
    monkeypatch.setenv("KILN_KERNELS", "reference")
    assert torch.allclose(fast, attnres.depth_attention(v, w), atol=1e-5)
