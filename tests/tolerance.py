"""The kernel tolerance of ARCHITECTURE.md: relative Frobenius error against a reference, in
float64; a NaN or an infinity never passes."""

from __future__ import annotations

import torch


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "not finite"
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
