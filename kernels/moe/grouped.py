"""The experts on CUDA through torch._grouped_mm (torch >= 2.8, Hopper): one grouped GEMM per
projection for all experts, no loop and no host sync (the group offsets stay on the device).
LoRA factors go through grouped GEMMs too. bf16 (the weights are cast as autocast casts them).
Same signature as the reference; ``usable`` says when it applies (bf16 or bf16 autocast, and
row lengths of 16 bytes: every width and the LoRA rank a multiple of 8)."""
from __future__ import annotations

from typing import Callable

import torch

from kernels.moe.reference import Lora


def usable(x_MD: torch.Tensor, gate_up_E2ID: torch.Tensor, down_EDI: torch.Tensor, lora: Lora | None) -> bool:
    if not (x_MD.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if not (x_MD.dtype == torch.bfloat16 or torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.bfloat16):
        return False
    dims = [*gate_up_E2ID.shape[1:], *down_EDI.shape[1:]] + [A.shape[1] for A, _ in (lora or {}).values()]
    return all(d % 8 == 0 for d in dims)


def gmm(x_MK: torch.Tensor, W_ENK: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group e times W_e^T: [M, K] x [E, N, K] -> [M, N]."""
    return torch._grouped_mm(x_MK, W_ENK.to(torch.bfloat16).transpose(-2, -1), offs=offs)


def mlp(gmm: Callable, x_MD: torch.Tensor, counts_E: torch.Tensor, gate_up_E2ID: torch.Tensor,
        down_EDI: torch.Tensor, act: Callable, lora: Lora | None = None, scaling: float = 1.0) -> torch.Tensor:
    """The experts through a grouped GEMM ``gmm`` (torch's here, Triton's in triton.py), in bf16."""
    lora = lora or {}
    offs = counts_E.cumsum(0).to(torch.int32)
    with torch.autocast("cuda", enabled=False):
        x = x_MD.to(torch.bfloat16)

        def proj(name: str, W: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            y = gmm(h, W, offs)
            if name in lora:
                A, B = lora[name]
                y = y + gmm(gmm(h, A, offs) * scaling, B, offs)  # scaled at rank r: M x r, not M x N
            return y

        gate, up = proj("gate_up_proj", gate_up_E2ID, x).chunk(2, -1)
        return proj("down_proj", down_EDI, act(gate, up))  # bf16, as F.linear under autocast gives


def grouped_mlp(x_MD: torch.Tensor, counts_E: torch.Tensor, gate_up_E2ID: torch.Tensor, down_EDI: torch.Tensor,
                act: Callable, lora: Lora | None = None, scaling: float = 1.0) -> torch.Tensor:
    return mlp(gmm, x_MD, counts_E, gate_up_E2ID, down_EDI, act, lora, scaling)
