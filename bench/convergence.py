"""Convergence in miniature: full training of kiln-tiny from random init on the sample data.

    .venv/bin/python -m bench.convergence [--steps 400] [--json bench/results/convergence.json]

Prints the loss at a few steps as a ratio to ln(vocab) (the loss of a uniform guess, the
baseline), and the seconds per step, and writes them to JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import engine
from engine.reporting import RecordingReporter
from kiln.spec import JobSpec
from kiln.store import LocalStore
from kiln.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "convergence.json")
    args = p.parse_args()
    sample = ROOT / "data" / "sample"
    rec = RecordingReporter()
    spec = JobSpec(
        job_id="bench-converge",
        model="kiln-tiny",
        training_file=str(sample / "train.jsonl"),
        validation_file=str(sample / "validation.jsonl"),
        images_file=str(sample / "images.zip"),
        training="full",
        n_epochs=100,
        batch_size=8,
        max_steps=args.steps,
        checkpoint_interval=100,
        seed=0,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        engine.train(spec, LocalStore(Path(d)), rec)
    seconds = time.perf_counter() - t0
    ln_v = math.log(ByteTokenizer.vocab_size)
    rows = []
    loss = rec.losses
    for s in sorted({1, 50, 100, 200, 300, args.steps} & set(loss)):
        window = [loss[i] for i in range(max(1, s - 9), s + 1)]
        rows.append(
            {
                "step": s,
                "train_loss_avg10": sum(window) / len(window),
                "ratio_to_ln_vocab": sum(window) / len(window) / ln_v,
                "valid_loss": rec.steps[s].get("valid_loss"),
            }
        )
    print(f"kiln-tiny, full training from random init, {args.steps} steps, ln(vocab) = {ln_v:.3f} (baseline)")
    print(f"{'step':>5} {'loss (10-step mean)':>20} {'/ ln(vocab)':>12} {'valid loss':>11}")
    for r in rows:
        v = f"{r['valid_loss']:.3f}" if r["valid_loss"] is not None else "-"
        print(f"{r['step']:>5} {r['train_loss_avg10']:>20.3f} {r['ratio_to_ln_vocab']:>12.3f} {v:>11}")
    print(f"{seconds / args.steps * 1000:.0f} ms per step")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"ln_vocab": ln_v, "rows": rows, "seconds": seconds, "steps": args.steps}, indent=2)
    )
    return 0 if rows[-1]["ratio_to_ln_vocab"] < 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
