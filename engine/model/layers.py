"""Small layers every model here uses."""
from __future__ import annotations

import torch
from torch import nn


def f32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: fp64 stays fp64 (the checks run the model in fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = f32(x)
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = f32(x)
        y = f32(self.weight) * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * torch.sigmoid(f32(gate))).to(x.dtype)
