"""Casts that cost nothing where they change nothing: a decode step calls the references on a
few rows, where each op's host time (0.7 us for a ``.to`` that returns its input, 0.2 us for
``torch.promote_types``) is the step's time, and most of their casts find the dtype already
right (fp32 on the CPU)."""

from __future__ import annotations

import torch

WIDE = (torch.float32, torch.float64)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 or wider (fp64 stays fp64: the checks run in fp64)."""
    return x if x.dtype in WIDE else x.float()


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)`` for a floating dtype."""
    return dtype if dtype in WIDE else torch.float32


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)
