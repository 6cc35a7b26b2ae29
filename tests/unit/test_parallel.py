"""FSDP2 + expert parallel on the CPU (gloo), launched by torchrun as a real run is: the sharded
step's loss and gradients equal one process computing the same step, and a DCP checkpoint
written on one layout loads on another (world size and EP size both change)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parallel_worker import ROWS, build, n_targets, step_loss

ROOT = Path(__file__).resolve().parents[2]


def torchrun(n: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "tests.parallel_worker", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode,world,ep", [("lora", 2, 2), ("full", 2, 1), ("full", 4, 2), ("lora", 4, 4)])
def test_sharded_step_equals_one_process(tmp_path, mode, world, ep):
    out = tmp_path / "out.pt"
    torchrun(world, "--mode", mode, "--ep", str(ep), "--out", str(out))
    got = torch.load(out)
    model, data = build(mode)  # one process, the same rows per part, the same normalisation
    expect = 0.0
    for r in range(world):
        loss = step_loss(model, data, list(range(r, ROWS, world)), n_targets(data), torch.device("cpu"))
        loss.backward()
        expect += float(loss.detach())
    assert got["loss"] == pytest.approx(expect, rel=1e-6)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(got["grads"]) == set(trained)
    assert any("experts" in n for n in trained)
    for n, p in trained.items():
        assert p.grad is not None and p.grad.norm() > 0, n
        assert tuple(got["grads"][n].shape) == tuple(p.shape), n  # whole tensors: all experts
        assert rel(got["grads"][n], p.grad) < 1e-5, (n, rel(got["grads"][n], p.grad))


def test_dcp_checkpoint_loads_on_other_world_and_ep_sizes(tmp_path):
    saved = tmp_path / "saved.pt"
    torchrun(2, "--mode", "lora", "--ep", "2", "--out", str(saved), "--save", str(tmp_path / "ckpt"))
    want = torch.load(saved)
    assert want["exp_avg"] and any(v.abs().sum() > 0 for v in want["exp_avg"].values())
    for world, ep in ((4, 4), (1, 1)):
        loaded = tmp_path / f"loaded-{world}-{ep}.pt"
        torchrun(world, "--mode", "lora", "--ep", str(ep), "--out", str(loaded), "--load", str(tmp_path / "ckpt"))
        got = torch.load(loaded)
        for part in ("params", "exp_avg"):
            assert set(got[part]) == set(want[part])
            for n in want[part]:
                assert torch.equal(got[part][n], want[part][n]), (world, ep, part, n)
