"""Which implementation of an op runs: the Triton kernel on CUDA, the PyTorch reference
elsewhere (the CPU, or ``KILN_KERNELS=reference`` anywhere, to compare or to debug)."""
from __future__ import annotations

import os

import torch


def fast(*tensors: torch.Tensor) -> bool:
    """True when the fast kernel should run on these inputs."""
    if os.environ.get("KILN_KERNELS", "auto") == "reference":
        return False
    return all(t.is_cuda for t in tensors)
