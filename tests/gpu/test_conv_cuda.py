"""KDA's short convolution in Triton against the float64 definition on fresh random inputs: the
output and the gradients of the input and the filter (trained or frozen), with and without the L2
norm per group of channels (q's and k's heads), with documents shorter than the filter, several
rows, odd token, channel and group counts, fp32 and bf16 (ARCHITECTURE.md's tolerances); bf16
autocast as F.conv1d takes it; and the dispatch. On a CPU the small fp32 cases run through
Triton's interpreter (tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.conv.reference import short_conv as definition
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(B: int, T: int, C: int, W: int, dtype, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(B, T, C, device=DEVICE, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(C, 1, W, device=DEVICE, generator=g) * 0.5).to(dtype).requires_grad_()
    dy = torch.randn(B, T, C, device=DEVICE, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "B,T,C,W,docs,norm",
    [
        (1, 37, 96, 4, None, 0),
        (2, 70, 130, 4, None, 0),
        (1, 45, 64, 4, [0, 1, 3, 20, 45], 0),
        (1, 33, 40, 3, [0, 2, 33], 0),
        (2, 50, 96, 4, None, 32),
        (1, 45, 64, 4, [0, 1, 3, 20, 45], 16),
        (1, 40, 72, 4, None, 24),  # L2 norm per group
        pytest.param(1, 4099, 12288, 4, [0, 1000, 1001, 3000, 4099], 0, marks=gpu_only),
        pytest.param(1, 4099, 4096, 4, [0, 1000, 1001, 3000, 4099], 128, marks=gpu_only),
        pytest.param(3, 513, 384, 4, None, 128, marks=gpu_only),
    ],
)
def test_matches_the_definition(B, T, C, W, docs, norm, dtype):
    from kiln_kernels.conv.triton import short_conv

    x, w, dy = inputs(B, T, C, W, dtype, T + C + norm)
    cu = torch.tensor(docs, device=DEVICE) if docs else None
    y = short_conv(x, w, cu, norm)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = definition(x64, w64, cu, norm)
    want.backward(dy.double())
    assert y.dtype == dtype and y.shape == (B, T, C)
    if norm:  # each group a unit vector
        assert torch.allclose(y.float().unflatten(-1, (-1, norm)).norm(dim=-1), torch.ones(()), atol=1e-2)
    assert rel(y, want) < TOL[dtype]
    assert rel(x.grad, x64.grad) < TOL[dtype] and rel(w.grad, w64.grad) < TOL[dtype]


def test_a_frozen_filter_gets_no_gradient_and_documents_stay_apart():
    """Only dx when the filter is frozen; a change in one document moves nothing in another."""
    from kiln_kernels.conv.triton import short_conv

    x, w, dy = inputs(1, 50, 64, 4, torch.float32, 5)
    w = w.detach()
    cu = torch.tensor([0, 20, 50], device=DEVICE)
    y = short_conv(x, w, cu)
    y.backward(dy)
    assert w.grad is None and rel(x.grad, torch.autograd.grad(definition(x, w, cu), x, dy)[0]) < 1e-5
    x2 = x.detach().clone()
    x2[:, 19] += 1.0  # the last token of the first document
    y2 = short_conv(x2, w, cu)
    assert torch.equal(y2[:, 20:], y.detach()[:, 20:]) and not torch.equal(y2[:, 19], y.detach()[:, 19])


@gpu_only
def test_autocast_takes_bf16_as_conv1d_does():
    from kiln_kernels.conv.triton import short_conv

    x, w, dy = inputs(1, 300, 256, 4, torch.float32, 9)  # an fp32 filter, as the model keeps it unstored
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = short_conv(x.bfloat16(), w, None, 64)
        want = definition(x.bfloat16(), w, None, 64)
    assert y.dtype == want.dtype == torch.bfloat16 and rel(y, want) < 1e-2
    y.float().backward(dy)
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


@gpu_only
def test_dispatch(monkeypatch):
    import kiln_kernels.conv as conv

    x, w, _ = inputs(2, 40, 128, 4, torch.float32, 2)
    fast = conv.short_conv(x, w)
    monkeypatch.setenv("KILN_KERNELS", "reference")
    assert torch.allclose(fast, conv.short_conv(x, w), atol=1e-5)
