"""RMSNorm and gated RMSNorm: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA: one
pass over each row forward, the row's 1/rms kept for the backward), one signature; dispatched by
device."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln_kernels.dispatch import fast
from kiln_kernels.norm import reference


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    impl: ModuleType  # the Triton module or the reference
    if fast(x, weight_D):
        from kiln_kernels.norm import triton as impl  # imports triton: CUDA machines only
    else:
        impl = reference
    return impl.rms_norm(x, weight_D, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    impl: ModuleType  # the Triton module or the reference
    if fast(x, gate, weight_D):
        from kiln_kernels.norm import triton as impl
    else:
        impl = reference
    return impl.gated_rms_norm(x, gate, weight_D, eps)


__all__ = ["gated_rms_norm", "rms_norm"]
