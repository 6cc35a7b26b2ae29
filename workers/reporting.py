"""The reporter the engine calls: every call is a small committed write, fenced by the lease
token so a worker that lost its job cannot write into it."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from api.db import session_scope
from api.models import Checkpoint, Job, JobEvent

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
    def __init__(self, job_id: str, token: str, poll_seconds: float = 1.0):
        self.job_id, self.token, self.poll_seconds = job_id, token, poll_seconds
        self._next_poll = 0.0
        self._stop: str | None = None
        self.lease_lost = False  # set by the heartbeat thread too

    def message(self, text: str, level: str = "info", data: dict[str, Any] | None = None) -> None:
        _retrying(lambda s: s.add(JobEvent(job_id=self.job_id, message=text, level=level, type="message", data=data)))

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        loss = values.get("train_loss")
        text = (
            f"Step {step}/{values.get('total_steps', '?')}: training loss={loss:.4f}"
            if loss is not None
            else f"Step {step}"
        )
        if "valid_loss" in values:
            text += f", validation loss={values['valid_loss']:.4f}"
        _retrying(lambda s: s.add(JobEvent(job_id=self.job_id, message=text, type="metrics", data=values)))

    def checkpoint(self, step: int, key: str, metrics: dict[str, Any]) -> None:
        def write(s: Session) -> None:
            s.execute(delete(Checkpoint).where(Checkpoint.job_id == self.job_id, Checkpoint.step == step))
            s.add(Checkpoint(job_id=self.job_id, step=step, store_key=key, metrics=metrics))
            s.add(JobEvent(job_id=self.job_id, message=f"Checkpoint saved at step {step}", data={"step": step}))

        _retrying(write)

    def resolved(self, hyperparameters: dict[str, Any]) -> None:
        _retrying(lambda s: self._resolved(s, hyperparameters))

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
        if self.lease_lost:
            return "lease_lost"
        now = time.monotonic()
        if self._stop is None and now >= self._next_poll:
            self._next_poll = now + self.poll_seconds
            row = _retrying(
                lambda s: s.execute(select(Job.cancel_requested, Job.lease_token).where(Job.id == self.job_id)).one()
            )
            if row.lease_token != self.token:
                self._stop = "lease_lost"
            elif row.cancel_requested:
                self._stop = "cancel"
        return self._stop

    def fenced_update(self, **values: Any) -> bool:
        """Update the job only while this worker still holds its lease."""
        return _retrying(
            lambda s: (
                s.execute(
                    update(Job).where(Job.id == self.job_id, Job.lease_token == self.token).values(**values)
                ).rowcount
                == 1
            )
        )
