"""Depth attention for AttnRes: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA and Ascend),
one signature; ``depth_attention`` picks by device."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl


def depth_attention(sources_LBTD: torch.Tensor, w_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return impl("depth_attention", sources_LBTD, w_D).depth_attention(sources_LBTD, w_D, eps)


__all__ = ["depth_attention"]
