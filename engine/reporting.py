"""A reporter that keeps everything in memory, for the engine's own uses: benchmarks and tests.
(The service's reporter writes to the database: workers/reporting.py.)"""

from __future__ import annotations

from typing import Any


class RecordingReporter:
    def __init__(self, stop_after: int | None = None):
        self.messages: list[str] = []
        self.steps: dict[int, dict[str, Any]] = {}  # every step's metrics
        self.checkpoints: list[tuple[int, str]] = []
        self.hyperparameters: dict[str, Any] = {}
        self.stop_after = stop_after  # ask the trainer to stop after this many steps

    @property
    def losses(self) -> dict[int, float]:
        return {s: v["train_loss"] for s, v in self.steps.items()}

    def message(self, text: str, level: str = "info", data: dict | None = None) -> None:
        self.messages.append(text)

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        self.steps[step] = values

    def checkpoint(self, step: int, key: str, metrics: dict[str, Any]) -> None:
        self.checkpoints.append((step, key))

    def resolved(self, hyperparameters: dict[str, Any]) -> None:
        self.hyperparameters = hyperparameters

    def should_stop(self) -> str | None:
        return "cancel" if self.stop_after is not None and len(self.steps) >= self.stop_after else None
