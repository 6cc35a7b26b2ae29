"""Kiln's training engine. The worker calls one function: ``engine.train(spec, store, reporter)``.

Importing this package does not import torch; ``train`` does.
"""

from __future__ import annotations

from engine.spec import Reporter, Store, TrainResult
from kiln.spec import JobSpec, LoraSpec, ParallelSpec


def train(spec: JobSpec, store: Store, reporter: Reporter) -> TrainResult:
    """Train in this process, or, with ``spec.parallel.nproc`` > 1, in that many under torchrun."""
    if spec.parallel.nproc > 1:
        from engine.launch import run

        return run(spec, store, reporter)
    from engine.trainer import train as _train

    return _train(spec, store, reporter)


__all__ = ["JobSpec", "LoraSpec", "ParallelSpec", "Reporter", "Store", "TrainResult", "train"]
