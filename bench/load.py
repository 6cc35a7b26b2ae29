"""Loopback load test of the API: N concurrent clients listing and polling for a bounded time.

    .venv/bin/python -m bench.load --clients 200 --seconds 30 --json bench/results/load.json

It starts its own deployment (PostgreSQL + Redis + one API process + one worker training a few
jobs, so polls see live data), then runs two phases with the same concurrency: the baseline
(``GET /healthz``: no auth, no database) and the mix (list jobs, get a job, list its events, list
files, list models: each authenticated, each a query). It prints p50/p99 per request kind with
the ratio to the baseline, and the error count, which must be zero. Traffic stays on 127.0.0.1,
and every loop is bounded by time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MAX_REQUESTS_PER_CLIENT = 10_000


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def _phase(base_url: str, keys: list[str], clients: int, seconds: float, requests) -> dict:
    lat: dict[str, list[float]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as http:

        async def client(i: int) -> None:
            rng = random.Random(i)
            headers = {"Authorization": f"Bearer {keys[i % len(keys)]}"}
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if time.monotonic() > deadline:
                    return
                name, path = rng.choice(requests)
                t0 = time.perf_counter()
                try:
                    r = await http.get(path, headers=headers)
                    ok = r.status_code == 200
                    if not ok:
                        errors.append(f"{name}: HTTP {r.status_code} {r.text[:120]}")
                except httpx.HTTPError as e:
                    ok = False
                    errors.append(f"{name}: {type(e).__name__}")
                if ok:
                    lat.setdefault(name, []).append((time.perf_counter() - t0) * 1000)

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.monotonic() - t0
    total = sum(len(v) for v in lat.values())
    return {"latency_ms": lat, "errors": errors, "requests": total, "seconds": wall, "rps": total / wall}


def run(base_url: str, keys: list[str], job_ids: list[str], clients: int, seconds: float) -> dict:
    baseline = asyncio.run(_phase(base_url, keys, clients, seconds / 3, [("healthz", "/healthz")]))
    mix = [("list jobs", "/v1/fine_tuning/jobs?limit=20"), ("list files", "/v1/files"), ("list models", "/v1/models")]
    for j in job_ids:
        mix += [("get job", f"/v1/fine_tuning/jobs/{j}"), ("list events", f"/v1/fine_tuning/jobs/{j}/events?limit=20")]
    load = asyncio.run(_phase(base_url, keys, clients, seconds, mix))
    base50, base99 = pct(baseline["latency_ms"]["healthz"], 50), pct(baseline["latency_ms"]["healthz"], 99)
    rows = []
    for name, xs in sorted(load["latency_ms"].items()):
        p50, p99 = pct(xs, 50), pct(xs, 99)
        rows.append(
            {
                "request": name,
                "count": len(xs),
                "p50_ms": p50,
                "p99_ms": p99,
                "p50_vs_baseline": p50 / base50,
                "p99_vs_baseline": p99 / base99,
            }
        )
    allx = [x for xs in load["latency_ms"].values() for x in xs]
    return {
        "clients": clients,
        "seconds": seconds,
        "baseline": {
            "request": "healthz",
            "count": baseline["requests"],
            "p50_ms": base50,
            "p99_ms": base99,
            "rps": baseline["rps"],
            "errors": len(baseline["errors"]),
        },
        "mix": {
            "count": load["requests"],
            "rps": load["rps"],
            "p50_ms": pct(allx, 50),
            "p99_ms": pct(allx, 99),
            "errors": len(load["errors"]),
            "first_errors": load["errors"][:5],
        },
        "rows": rows,
    }


def table(result: dict) -> str:
    b, m = result["baseline"], result["mix"]
    lines = [
        f"{result['clients']} clients, {result['seconds']:.0f} s; baseline healthz: {b['count']} requests, "
        f"{b['rps']:.0f}/s, p50 {b['p50_ms']:.1f} ms, p99 {b['p99_ms']:.1f} ms, {b['errors']} errors",
        f"{'request':<12} {'count':>7} {'p50 ms':>8} {'p99 ms':>8} {'p50/base':>9} {'p99/base':>9}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['request']:<12} {r['count']:>7} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
            f"{r['p50_vs_baseline']:>9.2f} {r['p99_vs_baseline']:>9.2f}"
        )
    lines.append(
        f"{'all':<12} {m['count']:>7} {m['p50_ms']:>8.1f} {m['p99_ms']:>8.1f}   "
        f"{m['rps']:.0f} requests/s, {m['errors']} errors"
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--keys", type=int, default=20, help="API keys the clients share")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "load.json")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.stack import REDIS_URL, Stack, create_pg_database, drop_pg_database

    name, url = create_pg_database()
    stack = Stack(Path(tempfile.mkdtemp(prefix="kiln-load-")), url, REDIS_URL, rate_limit_per_minute=0)
    try:
        stack.start(1)
        keys = [stack.admin("create-key", "--owner", "load") for _ in range(args.keys)]
        lines = (ROOT / "data" / "sample" / "train.jsonl").read_text().splitlines()
        text_only = "\n".join(line for line in lines if '"images"' not in line).encode()
        job_ids = []
        for i in range(3):
            with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {keys[i]}"}, timeout=60) as c:
                f = c.post(
                    "/v1/files", files={"file": ("train.jsonl", text_only)}, data={"purpose": "fine-tune"}
                ).json()
                job = {"model": "kiln-tiny", "training_file": f["id"], "hyperparameters": {"n_epochs": 50}}
                job_ids.append(c.post("/v1/fine_tuning/jobs", json=job).json()["id"])
        result = run(stack.base_url, keys, job_ids, args.clients, args.seconds)
    finally:
        stack.stop()
        drop_pg_database(name)
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0 if result["mix"]["errors"] == 0 and result["baseline"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
