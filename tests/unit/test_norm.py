"""kiln_kernels.norm's reference against its definition (w * round_x(x / sqrt(mean(x^2) + eps)),
in x's and w's wider dtype): one op where nothing rounds (x and w of one wide dtype), two where x
is narrower."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.norm import reference as ref


def definition(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    up = x.double()
    normed = (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return w.double() * normed.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(8, 1, 64), (3, 7, 96), (1, 33, 128)])
def test_a_wide_norm_is_one_op_and_the_definition(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, dtype=dtype) * 3
    w = torch.randn(shape[-1], generator=g, dtype=dtype)
    got = ref.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype
    # the two-op form it replaces, bit for bit
    assert torch.equal(got, w * torch.nn.functional.rms_norm(x, shape[-1:], eps=1e-6))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), definition(x, w, 1e-6), rtol=tol, atol=tol)


def test_a_narrow_input_is_rounded_before_the_wider_weight():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g)
    got = ref.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32  # the wider of the two, as transformers' norms give
    torch.testing.assert_close(got.double(), definition(x, w, 1e-6), rtol=1e-6, atol=1e-7)  # fp32's product
    unrounded = w * torch.nn.functional.rms_norm(x.float(), (64,), eps=1e-6)
    assert not torch.equal(got, unrounded)  # x r rounded to bf16 before the weight


def test_a_norm_for_matmuls_is_the_wide_norm_cast_each_way():
    """RMSNorm.for_matmuls under autocast: the norm in autocast's dtype, equal bit for bit to
    autocast_input of the wide norm, and so are the gradients through the linears that read it;
    without autocast, the norm as it is."""
    from engine.model.common.layers import RMSNorm, autocast_input

    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 9, 64, generator=g) * 2 + 0.3
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = 1 + torch.randn(64, generator=g) * 0.2
    lins = [torch.nn.Linear(64, 32) for _ in range(3)]
    outs = []
    for narrow in (False, True):
        x = x0.clone().requires_grad_()
        norm.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = norm.for_matmuls(x) if narrow else autocast_input(norm(x))
            loss = sum((lin(h).float() ** 2).sum() for lin in lins)
        loss.backward()
        outs.append((h, x.grad, norm.weight.grad))
    (h, dx, dw), (h2, dx2, dw2) = outs
    assert h2.dtype == torch.bfloat16 and torch.equal(h, h2)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
    assert torch.equal(norm.for_matmuls(x0), norm(x0))  # autocast off: the norm as it is
