"""MoE experts on grouped rows: ``reference.py`` (a loop over the experts, the definition) and
``grouped.py`` (torch._grouped_mm on CUDA) and ``npu.py`` (torch_npu.npu_grouped_matmul on an
Ascend NPU), one signature; ``grouped_mlp`` picks. ``triton.py``
has the permute / unpermute kernels the engine uses on CUDA. A Triton grouped GEMM, measured and
not used, is in ``kiln_kernels/experimental/grouped_gemm.py`` (measured: see bench/RESULTS.md,
"MoE grouped GEMM at torch's speed")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln_kernels.dispatch import impl
from kiln_kernels.moe import reference
from kiln_kernels.moe.reference import Lora


def grouped_mlp(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    chosen = impl("grouped_mlp", x_MD)
    if chosen is not reference and chosen.usable(x_MD, gate_up_E2ID, down_EDI, lora):
        return chosen.grouped_mlp(x_MD, counts_E, gate_up_E2ID, down_EDI, act, lora, scaling, w_M)
    return reference.grouped_mlp(x_MD, counts_E, gate_up_E2ID, down_EDI, act, lora, scaling, w_M)


__all__ = ["Lora", "grouped_mlp"]
