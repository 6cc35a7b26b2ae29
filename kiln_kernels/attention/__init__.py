"""Causal attention over packed documents (no [T, T] mask): ``reference.py`` (the definition,
and the per-document form the CPU runs), ``flash.py`` (CUDA: torch's variable-length flash and
memory-efficient kernels) and ``npu.py`` (Ascend: torch_npu.npu_fusion_attention, TND), one
signature; ``varlen_attention`` picks by device."""

from __future__ import annotations

import torch

from kiln_kernels.attention import reference
from kiln_kernels.dispatch import impl


def varlen_attention(
    q_THD: torch.Tensor,
    k_SHD: torch.Tensor,
    v_SHE: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] against k [S, H, D], v [S, H, E], documents cut by the host offsets ``cu_q`` and
    ``cu_k`` (``cu_k`` None: the same as ``cu_q``); o [T, H, E]. See reference.py."""
    chosen = impl("varlen_attention", q_THD, k_SHD, v_SHE)
    run = reference.per_document if chosen is reference else chosen.varlen_attention
    return run(q_THD, k_SHD, v_SHE, cu_q, cu_k, scale)


__all__ = ["varlen_attention"]
