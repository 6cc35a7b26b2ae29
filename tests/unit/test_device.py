"""The device layer (engine/device.py): the CPU here, and a stand-in ``npu`` device registered as
torch_npu registers the real one (tests/npu_standin.py, in a subprocess). Unit-tested on a
stand-in device: no NPU ran this."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

from engine import device
from engine.launch import check_devices
from tests.stack import ROOT


def test_the_cpu_when_no_accelerator():
    assert device.best() == "cpu" and device.resolve() == device.resolve("auto") == torch.device("cpu")
    cpu = torch.device("cpu")
    assert not device.accelerated(cpu) and isinstance(device.autocast(cpu), nullcontext)
    assert device.peak_memory_mb(cpu) > 10  # the process's peak RSS
    assert device.name(cpu) == "cpu" and device.rng_state() == {}
    assert device.dist_backend(cpu) == "gloo"
    with pytest.raises(ValueError, match="device 'npu' is not available here"):
        device.resolve("npu")  # torch_npu is not installed here: the NPU counts as absent


def test_the_cpu_counts_no_devices_and_the_launcher_no_limit():
    assert [device.count(), device.count("cpu"), device.count("npu")] == [0, 0, 0]
    assert device.visible_env() is None and device.visible_env("cuda") == "CUDA_VISIBLE_DEVICES"
    cpu = torch.device("cpu")
    device.reset_peak(cpu), device.empty_cache(cpu)  # nothing to do
    assert device.allocated(cpu) == device.max_allocated(cpu) == 0
    check_devices(64)  # gloo ranks: as many as the spec allows


@pytest.fixture(scope="module")
def npu():
    out = subprocess.run(
        [sys.executable, "-m", "tests.npu_standin"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_npu_is_chosen_and_named(npu):
    assert npu["best"] == "npu" and npu["resolve"] == "npu" and npu["resolve_1"] == "npu:1"
    assert npu["resolve_cuda"] == "device 'cuda' is not available here (found: npu)"
    assert npu["single"] == "npu"  # a one-process job trains there
    assert npu["name"] == "Ascend910B3"  # the job's worker kind, for the time estimates


def test_npu_autocast_memory_and_process_group(npu):
    assert npu["autocast"] == [True, "torch.bfloat16"] and npu["autocast_off"] is False
    assert npu["peak_mb"] == 3.0
    assert npu["backend"] == "hccl"
    assert npu["local_device"] == "npu:3"  # LOCAL_RANK's device, made current
    assert ["set_device", "3"] in npu["calls"] and ["synchronize", "npu"] in npu["calls"]


def test_npu_devices_are_counted_and_the_launcher_keeps_to_them(npu):
    assert npu["count"] == [8, 8, 0, 0]  # the best kind's, the NPU's; no CUDA, no CPU devices
    assert npu["visible_env"] == ["ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", None]
    assert npu["launch"]["nproc_9"] == (  # 8 ranks passed; 9 refused before torchrun starts
        "hyperparameters.parallel.nproc (9) is more than the 8 npu device(s) this worker sees "
        "(ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7): one process per device"
    )


def test_the_bench_timers_run_on_the_npu(npu):
    bench = npu["bench"]
    assert bench["dev"] == "npu" and bench["median_ms"] == 1.5
    one = [["Event", "True"], ["Event", "True"], ["synchronize", "npu"], ["record"], ["record"], ["synchronize", "npu"]]
    assert bench["timing_calls"] == one * 3  # the warm-up call untimed, then 3 timed ones
    assert bench["memory"] == [2**20, 3 * 2**20]
    assert bench["memory_calls"] == [
        ["reset_peak_memory_stats", "npu"],
        ["memory_allocated", "npu"],
        ["max_memory_allocated", "npu"],
        ["empty_cache"],
    ]


def test_npu_random_state_goes_into_checkpoints(npu):
    assert npu["rng"] == npu["trainer_state_rng"] == {"kind": "npu", "states": ["state0"]}
    # restored once: the CUDA run's state was not handed to the NPU
    assert [c for c in npu["calls"] if c[0] == "set_rng_state_all"] == [["set_rng_state_all", "['state0']"]]
