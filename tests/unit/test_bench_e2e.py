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


def test_a_sides_run_replaces_all_it_said_before(tmp_path):
    """A row of this device whose Kiln side once failed (its error, an old split) and whose
    transformers side ran: Kiln's new run leaves none of its old keys, and the other side's stay."""
    out = tmp_path / "e2e.json"
    old = {"tokens": 128, "layout": "single", "experts": False, "kiln_tokens_per_s": None, "kiln_peak_gib": None}
    old |= {"kiln_error": "out of memory", "kiln_split_ms": {"KDA": 1.0}, "kiln_date": "2026-12-01"}
    old |= {
        "hf_tokens_per_s": 10.0,
        "hf_peak_gib": 1.0,
        "hf_error": "kept: its side did not run",
        "kiln_first_step_s": None,
    }
    out.write_text(json.dumps({"rows": [old], "device": "cpu", "torch": "2.13.0", "date": "2026-12-01"}))

    check(tmp_path, out, 128)
    (row,) = json.loads(out.read_text())["rows"]
    assert "kiln_error" not in row and "kiln_split_ms" not in row  # --no-profile: no split this time
    assert row["kiln_tokens_per_s"] > 0 and row["kiln_date"] != "2026-12-01"
    assert row["hf_tokens_per_s"] == 10.0 and row["hf_error"] == old["hf_error"]
    assert row["speedup"] == row["kiln_tokens_per_s"] / 10.0
