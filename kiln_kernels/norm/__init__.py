"""RMSNorm and gated RMSNorm: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA and Ascend: one
pass over each row forward, the row's 1/rms kept for the backward), one signature; dispatched by
device."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    return impl("rms_norm", x, weight_D).rms_norm(x, weight_D, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    return impl("gated_rms_norm", x, gate, weight_D).gated_rms_norm(x, gate, weight_D, eps)


__all__ = ["gated_rms_norm", "rms_norm"]
