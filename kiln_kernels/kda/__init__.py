"""KDA, the gated delta rule with a per-channel decay: ``reference.py`` (the definition, CPU)
and ``triton.py`` (CUDA and Ascend), one signature; ``kda_chunk`` picks (``kiln_kernels.dispatch``). Its
decay gate likewise: ``reference.kda_gate`` and ``gate.py`` (CUDA and Ascend, one fused pass each way)."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl
from kiln_kernels.kda.reference import Gate, kda_recurrent, kda_step


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
    gate: Gate | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``gate``, g is the decay gate's raw projection and the decay ``kda_gate(g, *gate)``
    is made inside the kernels (never held in fp32)."""
    return impl("kda_chunk", q, k, v, g, beta).kda_chunk(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, gate
    )


def kda_gate(
    g_raw_BTHK: torch.Tensor,
    A_log_H: torch.Tensor,
    dt_bias_HK: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    return impl("kda_gate", g_raw_BTHK, A_log_H).kda_gate(g_raw_BTHK, A_log_H, dt_bias_HK, lower_bound)


__all__ = ["Gate", "kda_chunk", "kda_gate", "kda_recurrent", "kda_step"]
