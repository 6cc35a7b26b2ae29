"""The compose stack's smoke test (scripts/containers.sh smoke), through the published port with
Kiln's SDK: upload the sample dataset, fine-tune kiln-tiny (a few steps, in the worker
container), check the job succeeded, download its adapter and check the zip is a PEFT adapter.

    python docker/smoke.py --base-url http://127.0.0.1:8000 --api-key sk-...
"""

from __future__ import annotations

import argparse
import sys
import time
import zipfile
from pathlib import Path

import httpx

from kiln import Client

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--out", default="kiln-smoke-adapter.zip")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600, help="seconds the job may take")
    args = p.parse_args()
    deadline = time.time() + 60
    while True:  # the published port, from the host
        try:
            httpx.get(f"{args.base_url}/healthz", timeout=2).raise_for_status()
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                raise
            time.sleep(1)
    t0 = time.time()
    with Client(args.base_url, args.api_key) as client:
        train = client.files.upload(SAMPLE / "train.jsonl")
        validation = client.files.upload(SAMPLE / "validation.jsonl")
        images = client.files.upload(SAMPLE / "images.zip")
        print(f"uploaded {train.id}, {validation.id}, {images.id} in {time.time() - t0:.1f}s")
        t1 = time.time()
        job = client.jobs.create(
            "kiln-tiny",
            train.id,
            validation_file=validation.id,
            images_file=images.id,
            hyperparameters={"n_epochs": 1, "max_steps": args.max_steps, "batch_size": 8},
            seed=42,
            suffix="smoke",
        )
        print(f"created {job.id} ({job.status})")
        while job.status not in ("succeeded", "failed", "cancelled"):
            if time.time() - t1 > args.timeout:
                print(f"{job.id} still {job.status} after {args.timeout:.0f}s", file=sys.stderr)
                return 1
            time.sleep(2)
            job = client.jobs.get(job.id)
        events = client.jobs.events(job.id, limit=100)
        if job.status != "succeeded":
            for ev in events[-10:]:
                print(f"  {ev.message}", file=sys.stderr)
            print(f"{job.id} {job.status}: {job.error}", file=sys.stderr)
            return 1
        print(f"{job.id} succeeded in {time.time() - t1:.1f}s: {job.fine_tuned_model}, {job.trained_tokens} tokens")
        out = client.adapters.download(job.id, args.out)
    names = set(zipfile.ZipFile(out).namelist())
    if not {"adapter_config.json", "adapter_model.safetensors"} <= names:
        print(f"{out}: not a PEFT adapter: {sorted(names)}", file=sys.stderr)
        return 1
    print(f"adapter {out} ({out.stat().st_size} bytes): {', '.join(sorted(names))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
