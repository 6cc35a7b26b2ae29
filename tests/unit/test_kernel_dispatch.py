"""Kernel dispatch per backend (kiln_kernels/dispatch.py): CUDA kernel, Ascend variant or reference.

Here on the CPU (the reference, whatever forces it), and on the stand-in ``npu`` device of
tests/npu_standin.py in a subprocess (``python -m tests.unit.test_kernel_dispatch``): an NPU tensor
takes its op's Ascend variant where there is one and the reference where there is none, never the
CUDA kernel; dot precision and core counts are the NPU's. Tensors on the stand-in device cannot be
made (it has no allocator): the choices are asked of stand-ins that carry an ``npu`` device and a
dtype, which is all that dispatch reads. No NPU ran this.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln_kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_takes_the_references(monkeypatch):
    monkeypatch.delenv("KILN_KERNELS", raising=False)
    x = torch.zeros(2)
    assert dispatch.backend(x) == "reference" and not dispatch.fast(x)
    for op, entry in dispatch.OPS.items():
        assert dispatch.choice(op, x) == entry.reference
    assert dispatch.impl("rms_norm", x) is importlib.import_module("kiln_kernels.norm.reference")
    assert dispatch.dot_precision(x) == "ieee" and dispatch.dot_precision(x.bfloat16()) == "tf32"  # as before
    assert dispatch.sms(x) == 4  # the interpreter's persistent grids
    assert dispatch.to_device(x, "cpu") is x


def test_a_document_table_is_built_once_for_its_key_and_the_oldest_goes_first(monkeypatch):
    monkeypatch.setattr(dispatch, "_tables", type(dispatch._tables)())
    monkeypatch.setattr(dispatch, "TABLES", 2)
    built = []

    def table(n):
        return dispatch.document_table(("t", n), lambda: built.append(n) or torch.tensor([n]))

    first = table(1)
    assert table(1) is first and built == [1]  # the layers of a step share it
    table(2)
    table(1)  # used last: 2 is now the oldest
    table(3)
    assert built == [1, 2, 3] and table(1) is first
    table(2)
    assert built == [1, 2, 3, 2]  # evicted, so made again


def test_every_op_names_modules_that_exist():
    for op, entry in dispatch.OPS.items():
        for path in (entry.reference, entry.cuda, entry.npu):
            assert path is None or importlib.util.find_spec(path) is not None, (op, path)
        assert entry.why, op  # the Ascend choice is written down


@pytest.fixture(scope="module")
def npu():
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_KERNELS", "TRITON_ALL_BLOCKS_PARALLEL")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.unit.test_kernel_dispatch"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_npu_tensors_take_the_ascend_variants_or_the_references(npu):
    for op, entry in dispatch.OPS.items():
        assert npu["choice"][op] == (entry.npu or entry.reference), op
        assert npu["choice"][op] != entry.cuda or entry.cuda == entry.npu, op  # a CUDA-only kernel never
    assert npu["choice"]["rms_norm"] == "kiln_kernels.norm.triton"  # an Ascend variant (the same Triton source)
    assert npu["choice"]["varlen_attention"] == "kiln_kernels.attention.npu"  # torch_npu's fused operator
    assert npu["choice"]["grouped_mlp"] == "kiln_kernels.moe.npu"  # (a stand-in checks it: test_npu_fused.py)
    assert npu["backend"] == {"npu": "npu", "float64": "reference", "mixed": "reference", "forced": "reference"}
    assert npu["fast"] is False  # the engine's own CUDA-only paths (MoE permute) stay off on an NPU
    assert npu["all_blocks_parallel"] == "1"  # grids past 65,535 programs, mapped onto the cores


def test_npu_precision_and_core_counts(npu):
    assert npu["precision"] == {"fp32": "ieee", "bf16": "ieee"}  # triton-ascend rejects tf32
    assert npu["cores"] == {"cube": 20, "vector": 40, "npu:1 cube": 24}  # from the device properties


def _probe() -> dict:
    from tests.npu_standin import register

    module = register()
    props = {0: (20, 40), 1: (24, 48)}  # a 910B3, a 910B2

    def get_device_properties(index):
        cube, vector = props[index]
        return types.SimpleNamespace(name="Ascend910B", cube_core_num=cube, vector_core_num=vector)

    module.get_device_properties = get_device_properties  # type: ignore[attr-defined]
    module.current_device = lambda: 0  # type: ignore[attr-defined]

    def like(device: str, dtype: torch.dtype = torch.float32) -> Any:
        return types.SimpleNamespace(device=torch.device(device), dtype=dtype, is_cuda=False)

    x, y = like("npu:0"), like("npu:1", torch.bfloat16)
    out: dict = {"choice": {op: dispatch.choice(op, x, x) for op in dispatch.OPS}}
    out["backend"] = {
        "npu": dispatch.backend(x, y),
        "float64": dispatch.backend(x, like("npu", torch.float64)),
        "mixed": dispatch.backend(x, like("cpu")),
    }
    out["all_blocks_parallel"] = os.environ.get("TRITON_ALL_BLOCKS_PARALLEL")
    os.environ["KILN_KERNELS"] = "reference"
    out["backend"]["forced"] = dispatch.backend(x)
    del os.environ["KILN_KERNELS"]
    out["fast"] = dispatch.fast(x)
    out["precision"] = {"fp32": dispatch.dot_precision(x), "bf16": dispatch.dot_precision(y)}
    out["cores"] = {
        "cube": dispatch.sms(like("npu")),
        "vector": dispatch.sms(x, vector=True),
        "npu:1 cube": dispatch.sms(y),
    }
    return out


if __name__ == "__main__":
    print(json.dumps(_probe()))
