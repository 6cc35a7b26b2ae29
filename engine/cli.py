"""Run a fine-tune without the server: ``python -m engine.cli train config.yaml``.

The YAML holds JobSpec's fields (engine/spec.py); ``lora``, ``memory`` and
``parallel`` are mappings of LoraSpec's, MemorySpec's and ParallelSpec's. For example:

    model: kiln-tiny
    training_file: data/sample/train.jsonl
    validation_file: data/sample/validation.jsonl
    images_file: data/sample/images.zip
    n_epochs: 3
    lora: {rank: 8, alpha: 16}
    memory: {recompute: selective, tier: host}   # Swap Core; see engine/memory/swap_core.py
    parallel: {nproc: 2, ep_size: 2}             # torchrun: 2 processes, experts split 2 ways
                                                 # (cp_size: 2 splits each sequence over 2 ranks)

Checkpoints, the adapter and the base models live under ``--store`` (default ./kiln-data/store).
Ctrl-C stops after the current step; ``--resume`` continues from the job's last checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

import engine
from engine.memory import check_spec
from engine.reporting import ConsoleReporter
from engine.spec import JobSpec, LoraSpec, MemorySpec, ParallelSpec, check_parallel
from kiln.dataset import DatasetError
from kiln.store import LocalStore


def load_spec(path: Path, job_id: str | None) -> JobSpec:
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the config must be a mapping of JobSpec fields")
    known = {f.name for f in fields(JobSpec)} - {"job_id", "resume_from"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    parts: dict[str, Any] = {}
    for name, cls in (("lora", LoraSpec), ("memory", MemorySpec), ("parallel", ParallelSpec)):
        part = raw.pop(name, None) or {}
        unknown = sorted(set(part) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown {name} field(s) {', '.join(unknown)}")
        parts[name] = cls(**part)
    check_spec(parts["memory"])
    check_parallel(parts["parallel"])
    base = path.parent
    for key in ("training_file", "validation_file", "images_file"):  # relative to the config file
        if raw.get(key):
            raw[key] = str((base / raw[key]).resolve()) if not Path(raw[key]).is_absolute() else raw[key]
    if "model" not in raw or "training_file" not in raw:
        raise ValueError(f"{path}: model and training_file are required")
    return JobSpec(job_id=job_id or f"local-{path.stem}", **parts, **raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.cli", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fine-tune as the config says")
    t.add_argument("config", type=Path)
    t.add_argument("--store", type=Path, default=Path("kiln-data/store"))
    t.add_argument("--job-id")
    t.add_argument("--resume", action="store_true", help="continue from this job's last checkpoint")
    j = sub.add_parser("spec", help="print the job spec as JSON (for torchrun -m engine.launch)")
    j.add_argument("config", type=Path)
    j.add_argument("--job-id")
    args = p.parse_args(argv)
    try:
        spec = load_spec(args.config, args.job_id)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "spec":
        print(spec.to_json())
        return 0
    store = LocalStore(args.store)
    if args.resume:
        ckpts = sorted(store.path(f"{spec.artifacts}/checkpoints").glob("step-*"))
        spec.resume_from = f"{spec.artifacts}/checkpoints/{ckpts[-1].name}" if ckpts else None
    reporter = ConsoleReporter(sys.stderr.isatty())
    signal.signal(signal.SIGINT, lambda *_: setattr(reporter, "stop", "cancel"))
    try:
        result = engine.train(spec, store, reporter)
    except DatasetError as e:
        reporter.message(f"dataset error: {e}", level="error")
        return 2
    reporter._clear()
    if result.status != "succeeded":
        print(f"stopped after {result.final_metrics.get('step', 0)} steps; resume with --resume", flush=True)
        return 1
    assert result.adapter_key is not None  # a run that succeeded saved its adapter
    print(f"adapter: {store.path(result.adapter_key)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
