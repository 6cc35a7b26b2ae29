"""python -m engine.cli train config.yaml: a fine-tune without the server."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_train_from_a_yaml_config_then_resume(tmp_path):
    cfg = tmp_path / "job.yaml"
    sample = ROOT / "data" / "sample"
    cfg.write_text(
        f"model: kiln-tiny\ntraining_file: {sample / 'train.jsonl'}\nimages_file: {sample / 'images.zip'}\n"
        "max_steps: 12\ncheckpoint_interval: 5\nlora: {rank: 4, alpha: 8}\n"
        "memory: {recompute: selective, tier: host, cache_ops: [mm, grouped_mm]}\n"
    )
    out = run("train", str(cfg), "--store", str(tmp_path / "store"))
    assert out.returncode == 0, out.stderr
    assert "Recompute: selective, keeping mm, grouped_mm outputs on the host tier" in out.stdout
    assert "step 10/12 loss" in out.stdout and "checkpoint at step 5" in out.stdout
    adapter = Path(out.stdout.strip().splitlines()[-1].removeprefix("adapter: "))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(zipfile.ZipFile(adapter).namelist())
    again = run("train", str(cfg), "--store", str(tmp_path / "store"), "--resume")
    assert again.returncode == 0 and "Resumed from the checkpoint at step 12" in again.stdout


def test_bad_configs_are_refused_clearly(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: kiln-tiny\ntraining_file: x.jsonl\nn_epoch: 3\n")
    out = run("train", str(cfg))
    assert out.returncode == 2 and "n_epoch: unknown field; did you mean 'n_epochs'?" in out.stderr
    cfg.write_text("model: kiln-tiny\n")
    assert "training_file: Field required" in run("train", str(cfg)).stderr
    cfg.write_text("model: kiln-tiny\ntraining_file: x.jsonl\nmemory: {tier: disk}\n")
    assert "memory.tier: Input should be 'device', 'host' or 'auto'" in run("train", str(cfg)).stderr
    cfg.write_text("model: kiln-tiny\ntraining_file: x.jsonl\nmemory: {budget: 3}\n")
    assert "memory.budget: unknown field" in run("train", str(cfg)).stderr
    cfg.write_text("model: kiln-tiny\ntraining_file: x.jsonl\nparallel: {nproc: 2, ep_size: 3}\n")
    assert "hyperparameters.parallel.ep_size (3) must divide nproc (2)" in run("train", str(cfg)).stderr
    bad_data = tmp_path / "d.jsonl"
    bad_data.write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    cfg.write_text(f"model: kiln-tiny\ntraining_file: {bad_data}\n")
    out = run("train", str(cfg), "--store", str(tmp_path / "s"))
    assert out.returncode == 2 and "line 1: messages: no assistant message to learn from" in out.stdout
