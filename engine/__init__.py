"""Kiln's training engine. The worker calls one function: ``engine.train(spec, store, reporter)``.

Importing this package does not import torch; ``train`` does.
"""
from __future__ import annotations

from engine.spec import JobSpec, LoraSpec, Reporter, Store, TrainResult


def train(spec: JobSpec, store: Store, reporter: Reporter) -> TrainResult:
    from engine.trainer import train as _train

    return _train(spec, store, reporter)


__all__ = ["JobSpec", "LoraSpec", "Reporter", "Store", "TrainResult", "train"]
