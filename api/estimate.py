"""How long a job will take, from what finished jobs on the same model and worker kind measured.

Each succeeded job keeps its trained tokens and its worker's wall time (start-up, data indexing,
every step and checkpoint, the adapter; all attempts). A least-squares line, seconds = start-up +
tokens / throughput, through the latest of them gives the estimate; its spread on those jobs
gives the range. Without a finished job on the model the model card's rough throughput is all
there is, and the answer says so (``confidence: "none"``).
"""

from __future__ import annotations

from statistics import median
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Job
from kiln.catalog import CARDS

HISTORY = 20  # the latest finished jobs the estimate reads


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(start-up seconds, seconds per token) through (tokens, seconds); one point or one length:
    through the origin."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return 0.0, sum(y for _, y in points) / max(sum(xs), 1.0)
    mx, my = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:  # noise swamps the length: the mean rate
        return 0.0, my / mx
    return max(my - slope * mx, 0.0), slope


def estimate(session: Session, model: str, tokens: int) -> dict[str, Any]:
    rows = session.execute(
        select(Job.worker_kind, Job.trained_tokens, Job.run_seconds)
        .where(Job.model == model, Job.status == "succeeded", Job.run_seconds.is_not(None), Job.trained_tokens > 0)
        .order_by(Job.pk.desc())
        .limit(HISTORY)
    ).all()
    if not rows:
        rate = CARDS[model].tokens_per_second
        return {
            "seconds": round(tokens / rate, 1),
            "low": round(tokens / rate / 2, 1),
            "high": round(tokens / rate * 10, 1),
            "confidence": "none",
            "worker_kind": None,
            "basis": f"no finished job on {model} yet: a rough guess of {rate} tokens/s, start-up not counted",
        }
    kind = rows[0].worker_kind  # the kind that ran this model last
    points = [(float(r.trained_tokens), float(r.run_seconds)) for r in rows if r.worker_kind == kind]
    start, per_token = _fit(points)
    seconds = start + tokens * per_token
    ratios = [y / (start + x * per_token) for x, y in points]
    n = len(points)
    confidence = "low" if n < 3 else "medium" if n < 10 or max(ratios) / min(ratios) > 1.5 else "high"
    spread = (min(ratios), max(ratios)) if n >= 3 else (0.5, 2.0)
    return {
        "seconds": round(seconds, 1),
        "low": round(seconds * min(spread[0], 1.0), 1),
        "high": round(seconds * max(spread[1], 1.0), 1),
        "confidence": confidence,
        "worker_kind": kind,
        "basis": (
            f"{n} finished job{'s' if n > 1 else ''} on {model} ({kind}): {start:.0f} s start-up + "
            f"{1 / per_token:,.0f} tokens/s; the median job was off by {abs(median(ratios) - 1):.0%}"
        ),
    }
