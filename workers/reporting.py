"""The reporter the engine calls: every call is a small committed write, fenced by the lease
token (``api.lifecycle.fence``) so a worker that lost its job cannot write into it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from api import lifecycle
from api.db import session_scope
from api.models import Checkpoint, Job, JobEvent
from workers import metrics

log = logging.getLogger("kiln.worker")


def _retrying(write):
    """Run a small write transaction; a connection the database dropped mid-way is replaced and
    the write tried again (three times, backing off), so a PostgreSQL restart does not fail a job."""
    for attempt in range(4):
        try:
            with session_scope() as s:
                return write(s)
        except DBAPIError as e:
            if not e.connection_invalidated or attempt == 3:
                raise
            log.warning("database connection lost; retrying (%s)", e.orig)
            time.sleep(0.5 * 2**attempt)


class DBReporter:
    """The engine's reporter for one claimed job. Every write runs in one transaction behind
    ``lifecycle.fence`` (the job's row locked while this worker's lease holds); a write after the
    lease was lost is dropped and the trainer told to stop."""

    def __init__(self, job_id: str, token: str, poll_seconds: float = 1.0):
        self.job_id, self.token, self.poll_seconds = job_id, token, poll_seconds
        self._next_poll = 0.0
        self._stop: str | None = None
        self.lease_lost = False  # set by the heartbeat thread too

    def _write(self, write: Callable[[Session], Any]) -> Any:
        def fenced(s: Session) -> Any:
            if not lifecycle.fence(s, self.job_id, self.token):
                self.lease_lost = True
                return None
            return write(s)

        return _retrying(fenced)

    def message(self, text: str, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self._write(lambda s: s.add(JobEvent(job_id=self.job_id, message=text, level=level, type="message", data=data)))

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        """One metrics event per step: a resumed run replays the steps after its checkpoint (to
        the same losses) and their events are not written twice."""
        metrics.observe_step(values)
        loss = values.get("train_loss")
        text = (
            f"Step {step}/{values.get('total_steps', '?')}: training loss={loss:.4f}"
            if loss is not None
            else f"Step {step}"
        )
        if "valid_loss" in values:
            text += f", validation loss={values['valid_loss']:.4f}"

        def write(s: Session) -> None:
            seen = s.scalar(
                select(JobEvent.pk)
                .where(JobEvent.job_id == self.job_id, JobEvent.type == "metrics", JobEvent.step >= step)
                .limit(1)
            )
            if seen is None:
                s.add(JobEvent(job_id=self.job_id, message=text, type="metrics", step=step, data=values))

        self._write(write)

    def checkpoint(self, step: int, key: str, metrics: dict[str, Any]) -> None:
        def write(s: Session) -> None:
            s.execute(delete(Checkpoint).where(Checkpoint.job_id == self.job_id, Checkpoint.step == step))
            s.add(Checkpoint(job_id=self.job_id, step=step, store_key=key, metrics=metrics))
            s.add(JobEvent(job_id=self.job_id, message=f"Checkpoint saved at step {step}", data={"step": step}))

        self._write(write)

    def resolved(self, hyperparameters: dict[str, Any]) -> None:
        self._write(lambda s: self._resolved(s, hyperparameters))

    def _resolved(self, s: Session, hyperparameters: dict[str, Any]) -> None:
        job = s.scalar(select(Job).where(Job.id == self.job_id))
        assert job is not None  # the job row outlives its run
        job.hyperparameters = {
            **job.hyperparameters,
            **{k: hyperparameters[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
        }
        s.add(
            JobEvent(
                job_id=self.job_id,
                message="Hyperparameters: " + ", ".join(f"{k}={v}" for k, v in hyperparameters.items()),
                data=hyperparameters,
            )
        )

    def should_stop(self) -> str | None:
        """'lease_lost', 'cancel' or 'pause' (read from the job's row at most once a second)."""
        if self.lease_lost:
            return "lease_lost"
        t = time.monotonic()
        if self._stop is None and t >= self._next_poll:
            self._next_poll = t + self.poll_seconds
            self._stop = _retrying(lambda s: lifecycle.stop_reason(s, self.job_id, self.token))
        return self._stop

    def heartbeat(self, lease_seconds: float) -> bool:
        return _retrying(lambda s: lifecycle.heartbeat(s, self.job_id, self.token, lease_seconds))

    def finish(self, status: str, message: str, level: str = "info", **values: Any) -> bool:
        return _retrying(lambda s: lifecycle.finish(s, self.job_id, self.token, status, message, level, **values))
