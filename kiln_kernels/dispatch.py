"""Which implementation of an op runs: the Triton kernel on CUDA, the PyTorch reference
elsewhere (the CPU, float64 inputs, or ``KILN_KERNELS=reference`` anywhere, to compare or to
debug), and the hook through which Swap Core keeps a kernel's outputs (``kept``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


def sms(t: torch.Tensor) -> int:
    """The streaming multiprocessors of t's GPU (a persistent grid's size); 4 in Triton's
    interpreter (CPU tensors)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor (chunk tables, document offsets) onto ``device`` without a host sync: a
    plain copy from pageable memory waits for the stream, and the queue runs dry at every call."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda":  # already there, or no copy engine
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # the pinned block is reused only after the copy


# Swap Core (engine/memory) sets this while a recomputed block runs. ``kept(name, fn)`` then keeps
# fn's outputs in the block's forward and, in its recompute, hands them back instead of calling
# fn again: a kernel's forward whose outputs include what its backward saves is never rerun.
_keeper: Callable[[str, Callable[[], Any]], Any] | None = None


def kept(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, unless Swap Core keeps calls named ``name`` (kernels' forwards, selections)."""
    return fn() if _keeper is None else _keeper(name, fn)


@contextmanager
def keeping(keeper: Callable[[str, Callable[[], Any]], Any]) -> Iterator[None]:
    global _keeper
    before, _keeper = _keeper, keeper
    try:
        yield
    finally:
        _keeper = before
