"""What the worker hands the engine besides the job spec (``kiln.spec.JobSpec``, the one typed
contract from HTTP to the trainer): a store, a reporter, and what the run returns."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol


class Store(Protocol):
    def path(self, key: str) -> Path: ...
    def publish_dir(self, key: str) -> AbstractContextManager[Path]: ...
    def publish_file(self, key: str) -> AbstractContextManager[Path]: ...
    def model_dir(self, name: str) -> Path: ...


class Reporter(Protocol):
    def message(self, text: str, level: str = "info", data: dict[str, Any] | None = None) -> None: ...
    def metrics(self, step: int, values: dict[str, Any]) -> None: ...
    def checkpoint(self, step: int, key: str, metrics: dict[str, Any]) -> None: ...
    def resolved(self, hyperparameters: dict[str, Any]) -> None: ...
    def should_stop(self) -> str | None:
        """'cancel' when the user cancelled, 'lease_lost' when another worker took the job."""


@dataclass
class TrainResult:
    status: Literal["succeeded", "stopped"]
    adapter_key: str | None = None
    trained_tokens: int = 0
    stop_reason: str | None = None
    final_metrics: dict[str, Any] = field(default_factory=dict)
