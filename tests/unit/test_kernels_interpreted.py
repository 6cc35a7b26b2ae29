"""Every Triton kernel on the CPU: the GPU tests of DSA, MoE, the fused loss, AttnRes, KDA and its
short convolution, the RMSNorms (and of Swap Core keeping their outputs, and of a KDA layer
remaking its cheap activations) at their small fp32 shapes through Triton's interpreter, in a
process of its own that shares them between two workers (pytest-xdist: the suite waits here, so
both cores interpret). triton lives in .triton, which scripts/test.sh fills: on the CPU machine
it stays out of .venv, where it would send transformers' KDA to a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpret import triton_env

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    "tests/gpu/test_dsa_cuda.py",
    "tests/gpu/test_moe_triton.py",
    "tests/gpu/test_grouped_gemm.py",
    "tests/gpu/test_loss_cuda.py",
    "tests/gpu/test_attnres_cuda.py",
    "tests/gpu/test_kda_cuda.py",
    "tests/gpu/test_kept_kernels.py",
    "tests/gpu/test_conv_cuda.py",
    "tests/gpu/test_norm_cuda.py",
    "tests/gpu/test_remake.py",
]


QUIET = ["-W", "ignore::RuntimeWarning"]


# 204 s in two workers on the 2-core VM (377 s in one, which passed 600 s on a slow CI day)
@pytest.mark.timeout(900)
def test_triton_kernels_in_the_interpreter():
    env = triton_env(TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *QUIET, *FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "\n100 passed, 131 skipped" in run.stdout, run.stdout[-2000:]  # the small shapes ran, the GPU-only ones not


@pytest.mark.timeout(300)
def test_hoppers_gluon_kernels_compile_for_sm90():
    """DSA's Gluon forward and walk (kiln_kernels/dsa/hopper.py, which only a Hopper GPU runs)
    compile offline for sm_90a through Triton and ptxas (bench.regs): no spills, within a block's
    shared memory, two buffers of gathered rows, and their wgmma not serialised by ptxas (C7514:
    a product left in flight across the next one's issue did that, and cost the overlap)."""
    env = triton_env()
    run = subprocess.run(
        [sys.executable, "-m", "bench.regs", "dsa fwd hopper", "dsa walk hopper"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout
    for line in lines:
        assert "spills 0 B stored, 0 B loaded" in line and "(2 buffers a tile), wgmma," in line, line
        assert "serialised" not in line and "over the 227 KB" not in line, line
