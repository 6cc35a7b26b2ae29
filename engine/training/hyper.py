"""The job's hyperparameters resolved ("auto" made a number) and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.spec import JobSpec

BASE_LR = {"lora": 2e-3, "full": 1e-3}  # measured on kiln-tiny with the sample data; the multiplier scales it


@dataclass
class Resolved:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float
    total_steps: int
    steps_per_epoch: int
    checkpoint_interval: int
    warmup_steps: int

    def public(self) -> dict:
        return {
            "n_epochs": self.n_epochs,
            "batch_size": self.batch_size,
            "learning_rate_multiplier": self.learning_rate_multiplier,
            "learning_rate": self.learning_rate,
            "total_steps": self.total_steps,
            "checkpoint_interval": self.checkpoint_interval,
        }


def resolve(spec: JobSpec, n_examples: int) -> Resolved:
    bs = spec.batch_size if spec.batch_size != "auto" else max(1, min(8, n_examples // 8))
    bs = min(bs, n_examples)
    epochs = spec.n_epochs if spec.n_epochs != "auto" else 3
    mult = spec.learning_rate_multiplier if spec.learning_rate_multiplier != "auto" else 1.0
    per_epoch = math.ceil(n_examples / bs)
    total = per_epoch * epochs
    if spec.max_steps:
        total = min(total, spec.max_steps)
    interval = spec.checkpoint_interval or per_epoch
    return Resolved(
        epochs,
        bs,
        float(mult),
        BASE_LR[spec.training] * mult,
        total,
        per_epoch,
        interval,
        int(total * spec.warmup_ratio),
    )


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine down to 10%

    return f
