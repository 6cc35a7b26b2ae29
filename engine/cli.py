"""Run a fine-tune without the server: ``python -m engine.cli train config.yaml``.

The YAML holds JobSpec's fields (kiln/spec.py: the API's hyperparameters, ``lora`` and the
files), checked as the API checks a request. For example:

    model: kiln-tiny
    training_file: data/sample/train.jsonl
    validation_file: data/sample/validation.jsonl
    images_file: data/sample/images.zip
    n_epochs: 3
    lora: {rank: 8, alpha: 16}
    memory: {recompute: selective, tier: host}   # Swap Core; see engine/memory/swap_core.py
    parallel: {nproc: 2, ep_size: 2}             # torchrun: 2 processes, experts split 2 ways
                                                 # (cp_size: 2 splits each sequence over 2 ranks)

Checkpoints, the adapter and the base models live under ``--store`` (default ./kiln-data/store; or
``s3://bucket/prefix``, with local copies under ``--cache``, kiln/s3store.py).
Ctrl-C stops after the current step; ``--resume`` continues from the job's last checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

import engine
from engine.reporting import ConsoleReporter
from kiln.dataset import DatasetError
from kiln.spec import JobSpec, explain
from kiln.store import open_store


def load_spec(path: Path, job_id: str | None) -> JobSpec:
    """The YAML's JobSpec, validated as the API validates a request (unknown fields refused, with
    the known name closest to a typo); file paths relative to the config file."""
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the config must be a mapping of JobSpec fields")
    for key in ("job_id", "resume_from"):
        if key in raw:
            raise ValueError(f"{path}: {key} is set from the command line (--job-id, --resume), not the config")
    base = path.parent
    for key in ("training_file", "validation_file", "images_file"):
        if isinstance(raw.get(key), str) and not Path(raw[key]).is_absolute():
            raw[key] = str((base / raw[key]).resolve())
    try:
        return JobSpec.model_validate({"job_id": job_id or f"local-{path.stem}", **raw})
    except ValidationError as e:
        raise ValueError(f"{path}: {explain(e, JobSpec)[0]}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.cli", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fine-tune as the config says")
    t.add_argument("config", type=Path)
    t.add_argument("--store", default="kiln-data/store", help="a folder, file:///path or s3://bucket/prefix")
    t.add_argument("--cache", type=Path, default=Path("kiln-data/store-cache"), help="an S3 store's local copies")
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
    store = open_store(args.store, args.cache)
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
