"""bench/e2e.py's results file, through the bench's own CPU check (a tiny model, two steps): a run
adds its rows for its own device and keeps every other key of the file (the runs kept there by
hand, which tests/unit/test_plan.py reads); another device's table moves whole under a key of its
own instead of being mixed with this device's rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(tmp_path: Path, out: Path, tokens: int) -> None:
    args = ["--check", "--side", "kiln", "--tokens", str(tokens), "--layouts", "single", "--experts", "no"]
    args += ["--steps", "2", "--no-profile", "--out", str(out), "--ckpt", str(tmp_path / "ckpt")]
    run = subprocess.run(
        [sys.executable, "-m", "bench.e2e", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_a_run_keeps_the_file_and_moves_another_devices_table(tmp_path):
    out = tmp_path / "e2e.json"
    theirs = {
        "rows": [
            {"tokens": 8192, "layout": "single", "experts": False, "kiln_tokens_per_s": 80000.0, "kiln_peak_gib": 22.0}
            | {"hf_tokens_per_s": 40000.0, "hf_peak_gib": 45.8, "kiln_first_step_s": 5.1}
            | {"speedup": 2.0, "memory_ratio": 0.48}
        ],
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "date": "2026-12-06",
    }
    kept = {"same_call_h100_session30": {"rows": [{"tokens": 131072}]}}
    out.write_text(json.dumps({**theirs, **kept}))

    check(tmp_path, out, 128)
    now = json.loads(out.read_text())
    assert now["same_call_h100_session30"] == kept["same_call_h100_session30"]
    assert now["previous_nvidia_h200_2026_12_06"] == theirs
    assert now["device"] == "cpu" and [r["tokens"] for r in now["rows"]] == [128]

    check(tmp_path, out, 64)  # the same device again: its rows grow, nothing moves
    again = json.loads(out.read_text())
    assert sorted(r["tokens"] for r in again["rows"]) == [64, 128]
    assert again["previous_nvidia_h200_2026_12_06"] == theirs
    assert [k for k in again if k.startswith("previous_")] == ["previous_nvidia_h200_2026_12_06"]
