"""RMSNorm and the gated RMSNorm in Triton against the float64 definition on fresh random inputs:
the output and the gradients of x, the gate and the weight (trained or frozen), odd widths and row
counts, fp32 and bf16 (ARCHITECTURE.md's tolerances), the result's dtype as the reference gives it,
and the dispatch. On a CPU the small fp32 cases run through Triton's interpreter
(tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.norm import reference
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    "shape,trained",
    [
        ((37, 64), True),
        ((2, 13, 96), False),
        ((3, 5, 4, 40), True),
        pytest.param((4099, 4096), True, marks=gpu_only),
        pytest.param((1, 300, 7168), False, marks=gpu_only),
        pytest.param((2, 700, 32, 128), False, marks=gpu_only),
    ],
)
def test_matches_the_definition(shape, trained, gated, dtype):
    from kiln_kernels.norm import triton as impl

    g = torch.Generator(device=DEVICE).manual_seed(sum(shape) + gated)
    r = lambda *s, sc=1.0: torch.randn(*s, device=DEVICE, generator=g) * sc
    x = (r(*shape) * 3 + 0.5).to(dtype).requires_grad_()
    gate = (r(*shape) * 2).to(dtype).requires_grad_() if gated else None
    w = (1 + r(shape[-1], sc=0.3)).requires_grad_(trained)  # fp32, as the model keeps it
    dy_dtype = dtype if gated else torch.float32  # rms_norm gives fp32 for an fp32 weight
    dy = r(*shape).to(dy_dtype)
    y = impl.gated_rms_norm(x, gate, w, 1e-6) if gated else impl.rms_norm(x, w, 1e-6)
    y.backward(dy)
    d = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in (x, gate, w)]
    want = reference.gated_rms_norm(d[0], d[1], d[2], 1e-6) if gated else reference.rms_norm(d[0], d[2], 1e-6)
    want.backward(dy.double())
    assert y.dtype == dy_dtype and y.shape == x.shape
    assert rel(y, want) < TOL[dtype]
    assert rel(x.grad, d[0].grad) < TOL[dtype]
    if gated:
        assert rel(gate.grad, d[1].grad) < TOL[dtype]
    assert (rel(w.grad, d[2].grad) < TOL[dtype]) if trained else w.grad is None


def test_no_rows():
    from kiln_kernels.norm import triton as impl

    x = torch.randn(0, 64, device=DEVICE, requires_grad=True)
    y = impl.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6)
    y.sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64)


@gpu_only
def test_dispatch(monkeypatch):
    import kiln_kernels.norm as norm

    x, gate = (torch.randn(3, 50, 256, device=DEVICE) for _ in range(2))
    w = torch.rand(256, device=DEVICE)
    fast = norm.rms_norm(x, w, 1e-6), norm.gated_rms_norm(x, gate, w, 1e-6)
    monkeypatch.setenv("KILN_KERNELS", "reference")
    slow = norm.rms_norm(x, w, 1e-6), norm.gated_rms_norm(x, gate, w, 1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fast, slow, strict=True))


@gpu_only  # the interpreter rounds fp32 to bf16 toward zero, a GPU to nearest as torch does
@pytest.mark.parametrize("shape", [(37, 64), (2, 700, 2304)])
def test_a_narrower_result_is_the_wide_one_rounded_each_way(shape):
    """``dtype``: the result rounded to it in the kernel is the wide result rounded to nearest, and
    the gradients of x and the weight from a gradient in that dtype are the wide path's. Not bit
    for bit: a bf16 store and load lay the tile out otherwise across the threads, so the row sums
    add in another order (the H100 showed it, 2026-12-06); within one bf16 step of the wide result,
    almost all of it exactly its rounding, and the gradients at fp32's tolerance."""
    from kiln_kernels.norm import triton as impl

    g = torch.Generator(device=DEVICE).manual_seed(sum(shape))
    x0 = torch.randn(*shape, device=DEVICE, generator=g) * 3 + 0.5
    w0 = 1 + torch.randn(shape[-1], device=DEVICE, generator=g) * 0.3
    dy = torch.randn(*shape, device=DEVICE, generator=g).bfloat16()
    outs = []
    for narrow in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = impl.rms_norm(x, w, 1e-6, torch.bfloat16) if narrow else impl.rms_norm(x, w, 1e-6)
        (y if narrow else y.bfloat16()).backward(dy)
        outs.append((y, x.grad, w.grad))
    (wide, dx, dw), (y2, dx2, dw2) = outs
    assert y2.dtype == torch.bfloat16
    step = wide.detach().abs() * 2**-7  # one bf16 step (8 significant bits) of the wide result
    assert ((y2.float() - wide.detach()).abs() <= step).all()
    assert (y2 == wide.detach().bfloat16()).float().mean() > 0.99
    assert rel(dx2, dx) < 1e-5 and rel(dw2, dw) < 1e-5
