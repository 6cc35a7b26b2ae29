"""KDA, the gated delta rule with a per-channel decay: ``reference.py`` (the definition, CPU)
and ``triton.py`` (CUDA), one signature; ``kda_chunk`` picks (``kiln_kernels.dispatch``). Its
decay gate likewise: ``reference.kda_gate`` and ``gate.py`` (CUDA, one fused pass each way)."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln_kernels.dispatch import fast
from kiln_kernels.kda import reference
from kiln_kernels.kda.reference import kda_recurrent


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl: ModuleType  # the Triton module or the reference
    if fast(q, k, v, g, beta):
        from kiln_kernels.kda import triton as impl  # imports triton: CUDA machines only
    else:
        impl = reference
    return impl.kda_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)


def kda_gate(
    g_raw_BTHK: torch.Tensor,
    A_log_H: torch.Tensor,
    dt_bias_HK: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    impl: ModuleType  # the Triton module or the reference
    if fast(g_raw_BTHK, A_log_H):
        from kiln_kernels.kda import gate as impl  # imports triton: CUDA machines only
    else:
        impl = reference
    return impl.kda_gate(g_raw_BTHK, A_log_H, dt_bias_HK, lower_bound)


__all__ = ["kda_chunk", "kda_gate", "kda_recurrent"]
