"""Which implementation of an op runs: the Triton kernel on CUDA, the PyTorch reference
elsewhere (the CPU, float64 inputs, or ``KILN_KERNELS=reference`` anywhere, to compare or to
debug)."""
from __future__ import annotations

import os

import torch


def fast(*tensors: torch.Tensor) -> bool:
    """True when the fast kernel should run on these inputs: all on CUDA, none float64 (float64
    is for checking, and the kernels sum in fp32)."""
    if os.environ.get("KILN_KERNELS", "auto") == "reference":
        return False
    return all(t.is_cuda and t.dtype != torch.float64 for t in tensors)


def dot_precision(t: torch.Tensor) -> str:
    """``input_precision`` for a Triton kernel's dot products on inputs like ``t``: IEEE for fp32,
    so fp32 meets its 1e-5 tolerance (tf32 would not), the default elsewhere."""
    return "ieee" if t.dtype == torch.float32 else "tf32"
