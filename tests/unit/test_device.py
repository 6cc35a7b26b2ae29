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


def test_npu_random_state_goes_into_checkpoints(npu):
    assert npu["rng"] == npu["trainer_state_rng"] == {"kind": "npu", "states": ["state0"]}
    # restored once: the CUDA run's state was not handed to the NPU
    assert [c for c in npu["calls"] if c[0] == "set_rng_state_all"] == [["set_rng_state_all", "['state0']"]]
