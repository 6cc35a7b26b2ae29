"""The benches' clock: the median of device-event times of a call, after warm-up calls; and the rows
and table of the memory-bound kernels' benches (forward, forward + backward, GB/s); the results
file a run adds to (``carried``). The device is
``DEV``, the accelerator there is (CUDA, else an Ascend NPU), timed and named through the engine's
device layer (engine/device.py): on CUDA the same ``torch.cuda`` calls as ever."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from engine import device


def default_device() -> torch.device:
    """The accelerator the benches run on: CUDA, else an Ascend NPU; ``cuda`` where there is
    neither, so that a GPU bench fails there as it always did."""
    kind = device.best()
    return torch.device("cuda" if kind == "cpu" else kind)


DEV = default_device()


def median_ms(call: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    return statistics.median([device.elapsed_ms(DEV, call) for _ in range(reps)])


def sweep(config: dict, candidates: dict[str, list[dict]], timing: Callable[[], tuple[str, float]]) -> dict[str, dict]:
    """Each kernel's candidate settings in ``config`` (a kernel module's launch table), the others
    at their defaults, printed with ``timing()``'s line; a setting that does not compile (shared
    memory, registers) says so. The defaults are back in place after it. Returns each kernel's
    fastest setting (the least of ``timing()``'s number)."""
    defaults = {k: dict(v) for k, v in config.items()}
    best: dict[str, tuple[float, dict]] = {}
    try:
        for name, cands in candidates.items():
            for cand in cands:
                config.update(defaults)
                config[name] = cand
                try:
                    line, score = timing()
                except Exception as err:
                    print(f"{name} {cand}: failed ({type(err).__name__}: {str(err)[:80]})", flush=True)
                    continue
                print(f"{name} {cand}: {line}", flush=True)
                if name not in best or score < best[name][0]:
                    best[name] = (score, cand)
    finally:
        config.update(defaults)
    return {name: cand for name, (_, cand) in best.items()}


def pass_row(
    call: Callable[[], torch.Tensor],
    inputs: list[torch.Tensor],
    dy: torch.Tensor,
    want: torch.Tensor,
    fwd_bytes: int,
    both_bytes: int,
    base: dict | None,
) -> dict:
    """One method of a memory-bound op: forward and forward + backward (the inputs' gradients)
    median ms of 20 calls after 5, the bytes each must move over that time as GB/s, the speed
    against ``base`` (the baseline's row; None: this is it) and the output's error against ``want``."""
    with torch.no_grad():
        err = float((call().float() - want.float()).norm() / want.float().norm())
    fwd = median_ms(call, 20, 5)
    both = median_ms(lambda: torch.autograd.grad(call(), inputs, dy), 20, 5)
    base = base or {"fwd_ms": fwd, "fwd_bwd_ms": both}
    return {
        "fwd_ms": fwd,
        "fwd_bwd_ms": both,
        "fwd_GBps": fwd_bytes / fwd / 1e6,
        "fwd_bwd_GBps": both_bytes / both / 1e6,
        "fwd_speedup": base["fwd_ms"] / fwd,
        "fwd_bwd_speedup": base["fwd_bwd_ms"] / both,
        "rel_err": err,
    }


def report(title: str, rows: list[dict], keys: dict[str, int], baseline: str, out: Path) -> dict:
    """Print ``pass_row`` rows under ``title``, led by the ``keys`` columns (name: width), and
    write them to ``out`` as JSON."""
    print(f"\n{title}; baseline: {baseline}")
    print(
        " ".join(f"{k:>{w}}" for k, w in keys.items()) + f" {'fwd ms':>7} {'GB/s':>6} {'x base':>7} "
        f"{'f+b ms':>7} {'GB/s':>6} {'x base':>7} {'rel err':>8}"
    )
    for r in rows:
        print(
            " ".join(f"{str(r[k] or '-'):>{w}}" for k, w in keys.items())
            + f" {r['fwd_ms']:>7.3f} {r['fwd_GBps']:>6.0f} {r['fwd_speedup']:>6.2f}x {r['fwd_bwd_ms']:>7.3f} "
            f"{r['fwd_bwd_GBps']:>6.0f} {r['fwd_bwd_speedup']:>6.2f}x {r['rel_err']:>8.1e}"
        )
    done = {"device": device.name(DEV), "torch": torch.__version__, "baseline": baseline, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(done, indent=1))
    return done


def carried(done: dict, device: str) -> dict:
    """The results file a run adds its rows to: as it was, but where its table (``rows``) is
    another device's, that table (with its device, torch and date) moved under a key of its own,
    ``previous_<device>_<date>``, and ``rows`` started afresh: a run never mixes two devices'
    rows under one ``device``, nor drops the file's other keys."""
    if not done.get("rows") or done.get("device") in (None, device):
        return done
    old = {k: done[k] for k in ("rows", "device", "torch", "date") if k in done}
    key = re.sub(r"[^a-z0-9]+", "_", f"previous {old['device']} {old.get('date', '')}".lower()).strip("_")
    return {**{k: v for k, v in done.items() if k not in old}, key: old, "rows": []}
