"""The Triton MoE kernels the engine runs (kiln_kernels/moe/triton.py) against float64
references on fresh random inputs: permute / unpermute (output, the rows' gradient); the fused
SwiGLU, weighed by routing weights, on the gate/up product's rows and on two tensors (output and
gradients, the weights' too). On a
CPU these run through Triton's interpreter in fp32 (tests/unit/test_kernels_interpreted.py). The
Triton grouped GEMM's tests are in test_grouped_gemm.py."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.moe import reference
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize(
    "N,k,E,D,dtype",
    [
        (1, 1, 3, 8, torch.float32),
        (37, 4, 6, 50, torch.float32),
        pytest.param(37, 4, 6, 50, torch.bfloat16, marks=gpu_only),
        pytest.param(4096, 8, 64, 2048, torch.bfloat16, marks=gpu_only),
        pytest.param(4096, 8, 64, 2048, torch.float32, marks=gpu_only),
    ],
)
def test_permute_and_unpermute_match_the_reference(N, k, E, D, dtype):
    from kiln_kernels.moe import triton as fast

    g = torch.Generator(device=DEVICE).manual_seed(N + D)
    idx = torch.rand(N, E, device=DEVICE, generator=g).topk(k, -1).indices
    order = torch.argsort(idx.flatten(), stable=True)
    tok = order // k
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=DEVICE)
    inv = inv.view(N, k)
    x = torch.randn(N, D, device=DEVICE, generator=g).to(dtype).requires_grad_()
    lin = torch.randn(D, D, device=DEVICE, generator=g).to(dtype) * D**-0.5  # the "experts": one matrix
    dout = torch.randn(N, D, device=DEVICE, generator=g)
    out = fast.unpermute(fast.permute(x, tok, inv) @ lin, inv)
    out.backward(dout)
    x64 = x.detach().double().requires_grad_()
    want = reference.unpermute(reference.permute(x64, tok, inv) @ lin.double(), inv)
    want.backward(dout.double())
    tol = TOL[dtype]
    assert out.dtype == torch.float32 and x.grad.dtype == dtype  # fp32 sums, as the residual stream takes them
    assert rel(out, want) < tol and rel(x.grad, x64.grad) < tol


def test_unpermute_sums_bf16_rows_in_fp32():
    """bf16 expert rows, as the engine calls it: the sums and the output fp32 (not rounded to
    bf16 between the k rows), the rows' gradient each token's gradient in bf16."""
    from kiln_kernels.moe import triton as fast

    g = torch.Generator(device=DEVICE).manual_seed(3)
    N, k, D = 29, 3, 40
    inv = torch.randperm(N * k, device=DEVICE, generator=g).view(N, k)
    y = torch.randn(N * k, D, device=DEVICE, generator=g).bfloat16().requires_grad_()
    dout = torch.randn(N, D, device=DEVICE, generator=g)
    out = fast.unpermute(y, inv)
    out.backward(dout)
    y64 = y.detach().double().requires_grad_()
    want = reference.unpermute(y64, inv)
    want.backward(dout.double())
    assert out.dtype == torch.float32 and y.grad.dtype == torch.bfloat16
    assert rel(out, want) < 1e-6 and rel(y.grad, y64.grad) < 1e-2


@pytest.mark.parametrize(
    "M,I,dtype",
    [
        (1, 8, torch.float32),
        (37, 50, torch.float32),  # odd widths: the tile's masked columns and rows
        pytest.param(37, 50, torch.bfloat16, marks=gpu_only),
        pytest.param(8192, 1024, torch.bfloat16, marks=gpu_only),  # Kimi Linear's experts
        pytest.param(3000, 1536, torch.float32, marks=gpu_only),  # two column tiles
    ],
)
@pytest.mark.parametrize("weighed", [True, False])
def test_fused_swiglu_matches_the_reference(M, I, dtype, weighed):
    """The experts' activation, each row weighed by its routing weight (fp32, as the router gives
    it) or not: output, and the gradients of the gate/up rows and of the weights."""
    from kiln_kernels.moe import triton as fast

    g = torch.Generator(device=DEVICE).manual_seed(M + I)
    gu = (torch.randn(M, 2 * I, device=DEVICE, generator=g) * 3).to(dtype).requires_grad_()
    w = torch.rand(M, device=DEVICE, generator=g).requires_grad_() if weighed else None
    dh = torch.randn(M, I, device=DEVICE, generator=g).to(dtype)
    h = fast.swiglu_rows(gu, w)
    h.backward(dh)
    gu64 = gu.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    want = reference.swiglu_rows(gu64, w64)
    want.backward(dh.double())
    tol = TOL[dtype]
    assert h.dtype == gu.grad.dtype == dtype and h.shape == (M, I)
    assert rel(h, want) < tol and rel(gu.grad, gu64.grad) < tol
    if w is not None:
        assert w.grad.dtype == torch.float32 and rel(w.grad, w64.grad) < tol


def test_fused_swiglu_on_no_rows():
    from kiln_kernels.moe import triton as fast

    gu = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    w = torch.rand(0, device=DEVICE, requires_grad=True)
    h = fast.swiglu_rows(gu, w)
    h.sum().backward()
    assert h.shape == (0, 8) and gu.grad is not None and gu.grad.shape == (0, 16)
    assert w.grad is not None and w.grad.shape == (0,)


@pytest.mark.parametrize(
    "shape,dtype",
    [((3, 5, 40), torch.float32), pytest.param((2, 4096, 9216), torch.bfloat16, marks=gpu_only)],
)
def test_fused_swiglu_of_two_tensors_matches_the_reference(shape, dtype):
    """A dense MLP's SwiGLU (Kimi Linear's first layer, the shared experts): gate and up apart."""
    from kiln_kernels.moe import triton as fast

    g = torch.Generator(device=DEVICE).manual_seed(shape[-1])
    gate, up, dh = ((torch.randn(*shape, device=DEVICE, generator=g) * 3).to(dtype) for _ in range(3))
    gate.requires_grad_(), up.requires_grad_()
    h = fast.swiglu(gate, up)
    h.backward(dh)
    g64, u64 = (t.detach().double().requires_grad_() for t in (gate, up))
    want = reference.swiglu(g64, u64)
    want.backward(dh.double())
    tol = TOL[dtype]
    assert h.dtype == dtype and h.shape == shape
    assert rel(h, want) < tol and rel(gate.grad, g64.grad) < tol and rel(up.grad, u64.grad) < tol
