"""The Triton MoE kernels the engine runs (kiln_kernels/moe/triton.py) against float64
references on fresh random inputs: permute / unpermute with routing weights (output, gradients of
the rows and of the weights). On a CPU these run through Triton's interpreter in fp32
(tests/unit/test_kernels_interpreted.py). The Triton grouped GEMM's tests are in
test_grouped_gemm.py."""

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
        # bf16 where the Frobenius error averages over many weights (one token's single weight
        # gradient is a dot product that can cancel below bf16's resolution)
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
    w = torch.rand(N, k, device=DEVICE, generator=g).to(dtype).requires_grad_()
    lin = torch.randn(D, D, device=DEVICE, generator=g).to(dtype) * D**-0.5  # the "experts": one matrix
    dout = torch.randn(N, D, device=DEVICE, generator=g).to(dtype)
    out = fast.unpermute(fast.permute(x, tok, inv) @ lin, inv, w)
    out.backward(dout)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = reference.unpermute(reference.permute(x64, tok, inv) @ lin.double(), inv, w64)
    want.backward(dout.double())
    tol = TOL[dtype]
    assert out.dtype == dtype and rel(out, want) < tol
    assert rel(x.grad, x64.grad) < tol and rel(w.grad, w64.grad) < tol


def test_unpermute_keeps_the_routers_fp32_weights():
    """bf16 expert rows with fp32 routing weights, as the engine calls it: fp32 sums and output,
    the weights' gradient in fp32 (not rounded to bf16)."""
    from kiln_kernels.moe import triton as fast

    g = torch.Generator(device=DEVICE).manual_seed(3)
    N, k, D = 29, 3, 40
    inv = torch.randperm(N * k, device=DEVICE, generator=g).view(N, k)
    y = torch.randn(N * k, D, device=DEVICE, generator=g).bfloat16().requires_grad_()
    w = torch.rand(N, k, device=DEVICE, generator=g).requires_grad_()
    dout = torch.randn(N, D, device=DEVICE, generator=g)
    out = fast.unpermute(y, inv, w)
    out.backward(dout)
    y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = reference.unpermute(y64, inv, w64)
    want.backward(dout.double())
    assert out.dtype == torch.float32 and w.grad.dtype == torch.float32 and y.grad.dtype == torch.bfloat16
    assert rel(out, want) < 1e-6 and rel(w.grad, w64.grad) < 1e-6 and rel(y.grad, y64.grad) < 1e-2
