"""RMSNorm and gated RMSNorm: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA and Ascend: one
pass over each row forward, the row's 1/rms kept for the backward), one signature; dispatched by
device."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dtype``: the result's, rounded to it as the last step (default the wider of x's and the
    weight's: reference.py)."""
    return impl("rms_norm", x, weight_D).rms_norm(x, weight_D, eps, dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    return impl("gated_rms_norm", x, gate, weight_D).gated_rms_norm(x, gate, weight_D, eps)


__all__ = ["gated_rms_norm", "rms_norm"]
