"""The engine's reporters, each the ``engine.spec.Reporter`` protocol (the service's writes to the
database: workers/reporting.py):

- ``RecordingReporter`` keeps everything in memory (benchmarks and tests);
- ``ConsoleReporter``: messages as lines, metrics as a progress bar (``engine.cli``);
- ``FileReporter``: rank 0 of a parallel run, every call a JSON line for the go-between
  (``engine.launch``) to replay; ``SilentReporter`` the other ranks'."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
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


class ConsoleReporter:
    """Messages as lines, metrics as a progress bar (or lines when not on a terminal)."""

    def __init__(self, tty: bool):
        self.tty, self.stop, self.last_key = tty, None, None
        self.t0 = time.monotonic()

    def message(self, text, level="info", data=None):
        self._clear()
        print(f"[{level}] {text}", flush=True)

    def metrics(self, step, values):
        total = values.get("total_steps") or step
        line = (
            f"step {step}/{total} loss {values['train_loss']:.4f}"
            + (f" valid {values['valid_loss']:.4f}" if "valid_loss" in values else "")
            + f" {values.get('tokens_per_second', 0):.0f} tok/s"
        )
        if self.tty:
            done = int(30 * step / total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {line}  ")
            sys.stderr.flush()
        elif step % 10 == 0 or "valid_loss" in values or step == total:
            print(line, flush=True)

    def checkpoint(self, step, key, metrics):
        self.last_key = key
        self.message(f"checkpoint at step {step}: {key}")

    def resolved(self, hyperparameters):
        self.message("hyperparameters: " + ", ".join(f"{k}={v}" for k, v in hyperparameters.items()))

    def should_stop(self):
        return self.stop

    def _clear(self):
        if self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")


class FileReporter:
    """Rank 0's reporter: every call a JSON line; ``should_stop`` reads the stop file, and says
    ``lease_lost`` once the process that launched the run (``KILN_LAUNCHER_PID``) is gone: a
    worker killed mid-job must not leave a run training beside the one that resumes the job."""

    def __init__(self, events: Path, stop: Path):
        self.events, self.stop = events.open("a", buffering=1), stop
        self.launcher = int(os.environ.get("KILN_LAUNCHER_PID", 0))

    def _write(self, kind: str, **fields: Any) -> None:
        self.events.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")

    def message(self, text: str, level: str = "info", data: dict | None = None) -> None:
        self._write("message", text=text, level=level, data=data)

    def metrics(self, step: int, values: dict) -> None:
        self._write("metrics", step=step, values=values)

    def checkpoint(self, step: int, key: str, metrics: dict) -> None:
        self._write("checkpoint", step=step, key=key, metrics=metrics)

    def resolved(self, hyperparameters: dict) -> None:
        self._write("resolved", hyperparameters=hyperparameters)

    def should_stop(self) -> str | None:
        if self.launcher and not _alive(self.launcher):
            return "lease_lost"
        return self.stop.read_text().strip() or None if self.stop.exists() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SilentReporter:
    """The other ranks': they train, rank 0 speaks."""

    def message(self, text, level="info", data=None): ...
    def metrics(self, step, values): ...
    def checkpoint(self, step, key, metrics): ...
    def resolved(self, hyperparameters): ...
    def should_stop(self):
        return None
