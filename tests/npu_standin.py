"""A stand-in ``npu`` device on the CPU build of torch, registered the way torch_npu registers
the real one (the PrivateUse1 backend renamed, a device module, HCCL for the process group):
device, autocast, backend and dispatch choices behave as with torch_npu; tensor ops on it do not.
Run as ``python -m tests.npu_standin``: it registers the stand-in, asks the engine's choices and
prints them as JSON (a subprocess, since the registration cannot be undone)."""

from __future__ import annotations

import json
import os
import types

import torch
import torch.distributed as dist

CALLS: list[list] = []


def _record(name, result=None):
    def call(*args):
        CALLS.append([name, *[str(a) for a in args]])
        return result

    return call


class Event:
    """A timing event: ``elapsed_time`` says 1.5 ms."""

    def __init__(self, enable_timing: bool = False):
        CALLS.append(["Event", str(enable_timing)])

    def record(self, stream=None) -> None:
        CALLS.append(["record"])

    def elapsed_time(self, end: Event) -> float:
        return 1.5


def register() -> types.ModuleType:
    torch.utils.rename_privateuse1_backend("npu")
    npu = types.ModuleType("npu")
    npu.is_available = lambda: True  # type: ignore[attr-defined]
    npu.device_count = lambda: 8  # type: ignore[attr-defined]
    npu.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]  # type: ignore[attr-defined]
    npu.max_memory_allocated = _record("max_memory_allocated", 3 * 2**20)  # type: ignore[attr-defined]
    npu.memory_allocated = _record("memory_allocated", 2**20)  # type: ignore[attr-defined]
    npu.reset_peak_memory_stats = _record("reset_peak_memory_stats")  # type: ignore[attr-defined]
    npu.empty_cache = _record("empty_cache")  # type: ignore[attr-defined]
    npu.Event = Event  # type: ignore[attr-defined]
    npu.get_device_name = _record("get_device_name", "Ascend910B3")  # type: ignore[attr-defined]
    npu.set_device = _record("set_device")  # type: ignore[attr-defined]
    npu.synchronize = _record("synchronize")  # type: ignore[attr-defined]
    npu.get_rng_state_all = _record("get_rng_state_all", ["state0"])  # type: ignore[attr-defined]
    npu.set_rng_state_all = _record("set_rng_state_all")  # type: ignore[attr-defined]
    torch._register_device_module("npu", npu)

    def hccl(*_args, **_kwargs):
        raise RuntimeError("the stand-in has no collectives")

    dist.Backend.register_backend("hccl", hccl, devices=["npu"])
    return npu


def probe() -> dict:
    register()
    from engine import device
    from engine.training.checkpointer import trainer_state
    from engine.training.ranks import Single

    npu = torch.device("npu")
    out: dict = {"best": device.best(), "resolve": str(device.resolve()), "resolve_1": str(device.resolve("npu:1"))}
    try:
        device.resolve("cuda")
    except ValueError as e:
        out["resolve_cuda"] = str(e)
    with device.autocast(npu):
        out["autocast"] = [torch.is_autocast_enabled("npu"), str(torch.get_autocast_dtype("npu"))]
    out["autocast_off"] = torch.is_autocast_enabled("npu")
    out["peak_mb"] = device.peak_memory_mb(npu)
    out["name"] = device.name(npu)
    device.synchronize(npu)
    out["backend"] = device.dist_backend(npu)
    os.environ["LOCAL_RANK"] = "3"
    out["local_device"] = str(device.local_device())
    out["rng"] = device.rng_state()
    device.set_rng_state({"kind": "cuda", "states": ["from a CUDA run"]})  # another kind's: left alone
    device.set_rng_state(out["rng"])
    out["single"] = str(Single().device)
    out["trainer_state_rng"] = trainer_state(0, 0, torch.optim.lr_scheduler.LambdaLR(_opt(), lambda s: 1.0))[
        "device_rng"
    ]
    out["count"] = [device.count(), device.count("npu"), device.count("cuda"), device.count("cpu")]
    out["visible_env"] = [device.visible_env(), device.visible_env("cuda"), device.visible_env("cpu")]
    out["launch"] = _launch()
    out["bench"] = _bench(npu)
    out["calls"] = CALLS
    return out


def _launch() -> dict:
    """The parallel launcher's check, before torchrun: as many ranks as visible NPUs, not one more."""
    from engine.launch import check_devices

    os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"
    check_devices(8)
    try:
        check_devices(9)
    except ValueError as e:
        return {"nproc_9": str(e)}
    return {"nproc_9": None}


def _bench(npu: torch.device) -> dict:
    """The benches' device, clock and memory calls, through the device layer."""
    from bench import cuda_time
    from engine import device

    start = len(CALLS)
    out = {"dev": str(cuda_time.DEV), "median_ms": cuda_time.median_ms(lambda: None, reps=3, warmup=1)}
    out["timing_calls"], start = CALLS[start:], len(CALLS)
    device.reset_peak(npu)
    out["memory"] = [device.allocated(npu), device.max_allocated(npu)]
    device.empty_cache(npu)
    out["memory_calls"] = CALLS[start:]
    return out


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


if __name__ == "__main__":
    print(json.dumps(probe()))
