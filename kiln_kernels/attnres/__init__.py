"""Depth attention for AttnRes: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA),
one signature; ``depth_attention`` picks by device."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln_kernels.attnres import reference
from kiln_kernels.dispatch import fast


def depth_attention(sources_LBTD: torch.Tensor, w_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    impl: ModuleType  # the Triton module or the reference
    if fast(sources_LBTD, w_D):
        from kiln_kernels.attnres import triton as impl  # imports triton: CUDA machines only
    else:
        impl = reference
    return impl.depth_attention(sources_LBTD, w_D, eps)


__all__ = ["depth_attention"]
