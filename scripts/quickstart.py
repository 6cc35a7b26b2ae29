"""Drive one fine-tune through the HTTP API: upload the sample dataset, start a job, follow its
live events, download the adapter, then ask the fine-tuned model a question through the official
openai SDK (the API passes it to the inference server). Used by scripts/quickstart.sh."""

from __future__ import annotations

import argparse
import json
import sys
import time
import zipfile
from pathlib import Path

import httpx
from openai import OpenAI

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--out", default="kiln-adapter.zip")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    c = httpx.Client(base_url=args.base_url, headers={"Authorization": f"Bearer {args.api_key}"}, timeout=120)
    deadline = time.time() + 60
    while True:
        try:
            c.get("/healthz").raise_for_status()
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                print("the API did not come up; see kiln-data/logs/api.log", file=sys.stderr)
                return 1
            time.sleep(0.3)

    def upload(name: str) -> str:
        r = c.post("/v1/files", files={"file": (name, (SAMPLE / name).read_bytes())}, data={"purpose": "fine-tune"})
        r.raise_for_status()
        f = r.json()
        print(f"uploaded {name}: {f['id']} ({f['bytes']} bytes, {f['stats'].get('examples', 0)} examples)")
        return f["id"]

    body = {
        "model": "kiln-tiny",
        "training_file": upload("train.jsonl"),
        "validation_file": upload("validation.jsonl"),
        "images_file": upload("images.zip"),
        "suffix": "quickstart",
        "seed": 42,
        "hyperparameters": {"n_epochs": args.epochs, "batch_size": 8},
    }
    r = c.post("/v1/fine_tuning/jobs", json=body)
    if r.status_code != 200:
        print(r.json()["error"]["message"], file=sys.stderr)
        return 1
    job = r.json()
    print(f"created {job['id']} ({job['status']}); following its events")
    losses = []
    with c.stream("GET", f"/v1/fine_tuning/jobs/{job['id']}/events/stream", timeout=None) as s:
        kind = None
        for line in s.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind in ("message", "metrics"):
                ev = json.loads(line[6:])
                if kind == "metrics":
                    losses.append(ev["data"]["train_loss"])
                    if ev["data"]["step"] % 10 and "valid_loss" not in ev["data"]:
                        continue
                print(f"  {ev['message']}")
            elif line.startswith("data: ") and kind == "end":
                break
    job = c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    if job["status"] != "succeeded":
        print(f"job {job['status']}: {job['error']}", file=sys.stderr)
        return 1
    with c.stream("GET", f"/v1/fine_tuning/jobs/{job['id']}/adapter") as r:
        r.raise_for_status()
        with open(args.out, "wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
    names = zipfile.ZipFile(args.out).namelist()
    print(
        f"\n{job['fine_tuned_model']}: training loss {losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f} "
        f"over {len(losses)} steps, {job['trained_tokens']} tokens"
    )
    print(f"adapter saved to {args.out}: {', '.join(names)}")
    # max_retries: the SDK's backoff also covers an inference server still starting (a 503)
    oai = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key, max_retries=5)
    question = "What is 11 + 7?"
    chat = oai.chat.completions.create(
        model=job["fine_tuned_model"],
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    )
    print(f"\nasked {job['fine_tuned_model']}: {question} -> {chat.choices[0].message.content!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
