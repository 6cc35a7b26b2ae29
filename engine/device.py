"""The accelerator behind one module: CUDA, an Ascend NPU (torch_npu) or the CPU.

The engine asks here which device to use, how to run bf16 autocast on it, its streams and events,
its memory statistics and random state, how many of it this process sees, and which distributed
backend its process group takes (nccl, hccl, gloo); the benches time and measure through it too.
Outside this module no engine code names ``torch.cuda``: on CUDA every call below is the
``torch.cuda`` call it replaces (``torch.get_device_module("cuda")`` is ``torch.cuda``), and
torch_npu gives ``torch.npu`` the same surface.

An NPU is used when ``torch_npu`` imports and ``torch.npu.is_available()``; importing it needs
CANN (without it, ``import torch_npu`` fails and the NPU counts as absent). Checked here on a
stand-in ``npu`` device (tests/unit/test_device.py), never on an NPU yet.
"""

from __future__ import annotations

import functools
import importlib
import os
import resource
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

ACCELERATORS = ("cuda", "npu")
# the variable that narrows the devices a process sees, per kind (device_count honours it)
VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


@functools.lru_cache
def _npu_importable() -> bool:
    if hasattr(torch, "npu"):  # torch_npu (or a stand-in) already registered
        return True
    try:
        importlib.import_module("torch_npu")
    except Exception:  # not installed, or no CANN beneath it
        return False
    return hasattr(torch, "npu")


def available(kind: str) -> bool:
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "npu":
        return _npu_importable() and torch.npu.is_available()  # type: ignore[attr-defined]
    return False


def best() -> str:
    """The first kind there is: cuda, npu, cpu."""
    return next(k for k in (*ACCELERATORS, "cpu") if available(k))


def resolve(name: str | torch.device | None = None) -> torch.device:
    """A device from a name (``auto`` or empty: the best there is; ``cuda``, ``npu:1``, ``cpu``);
    an accelerator that is not there is an error naming it."""
    if isinstance(name, torch.device):
        return name
    if not name or name == "auto":
        return torch.device(best())
    if not available(name.partition(":")[0]):  # before torch.device: "npu" means nothing without torch_npu
        raise ValueError(f"device {name!r} is not available here (found: {best()})")
    return torch.device(name)


def count(kind: str | None = None) -> int:
    """How many devices of ``kind`` (default: the best there is) this process sees, after
    ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``; 0 for the CPU or an absent kind."""
    kind = kind or best()
    if kind not in ACCELERATORS or not available(kind):
        return 0
    return int(torch.get_device_module(kind).device_count())


def visible_env(kind: str | None = None) -> str | None:
    """The environment variable that picks the visible devices of ``kind`` (default: the best
    there is): ``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``; None for the CPU."""
    return VISIBLE_ENV.get(kind or best())


def accelerated(device: torch.device) -> bool:
    return device.type in ACCELERATORS


def module(device: torch.device) -> Any:
    """``torch.cuda`` or ``torch.npu``: streams, events, memory, random state."""
    assert accelerated(device), device
    return torch.get_device_module(device.type)


def autocast(device: torch.device, enabled: bool = True) -> AbstractContextManager:
    """bf16 autocast on an accelerator; nothing on the CPU (fp32 there)."""
    if not accelerated(device):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def peak_memory_mb(device: torch.device) -> float:
    """The most memory the device held since the last reset (the CPU: the process's peak RSS)."""
    if accelerated(device):
        return max_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synchronize(device: torch.device) -> None:
    if accelerated(device):
        module(device).synchronize(device)


def event(device: torch.device) -> Any:
    """A timing event on the device's current stream (``torch.cuda.Event(enable_timing=True)``)."""
    return module(device).Event(enable_timing=True)


def elapsed_ms(device: torch.device, call: Callable[[], object]) -> float:
    """One call's device time in ms, between two timing events, the device idle before and after."""
    a, b = event(device), event(device)
    synchronize(device)
    a.record()
    call()
    b.record()
    synchronize(device)
    return a.elapsed_time(b)


def allocated(device: torch.device) -> int:
    """Bytes of tensors the device holds now (0 on the CPU)."""
    return module(device).memory_allocated(device) if accelerated(device) else 0


def max_allocated(device: torch.device) -> int:
    """The most bytes of tensors the device held since the last ``reset_peak`` (0 on the CPU)."""
    return module(device).max_memory_allocated(device) if accelerated(device) else 0


def reset_peak(device: torch.device) -> None:
    if accelerated(device):
        module(device).reset_peak_memory_stats(device)


def empty_cache(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back (nothing on the CPU)."""
    if accelerated(device):
        module(device).empty_cache()


def name(device: torch.device) -> str:
    """What a job ran on, for the time estimates: the accelerator's name, else "cpu"."""
    return module(device).get_device_name(device) if accelerated(device) else "cpu"


def rng_state() -> dict[str, Any]:
    """Every accelerator's random state (a checkpoint's exact resume)."""
    kind = best()
    return {"kind": kind, "states": module(torch.device(kind)).get_rng_state_all()} if kind != "cpu" else {}


def set_rng_state(saved: dict[str, Any] | None) -> None:
    if saved and saved.get("kind") == best():
        module(torch.device(saved["kind"])).set_rng_state_all(saved["states"])


def local_device() -> torch.device:
    """This rank's device under torchrun: the accelerator numbered LOCAL_RANK, made current."""
    kind = best()
    if kind == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))
    module(torch.device(kind)).set_device(index)
    return torch.device(kind, index)


def dist_backend(device: torch.device) -> str:
    """The process group's backend for the device: nccl (CUDA), hccl (NPU), gloo (CPU)."""
    return dist.get_default_backend_for_device(device)
