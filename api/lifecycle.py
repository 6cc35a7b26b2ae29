"""A fine-tuning job's statuses and every transition between them, in one place: the routes call
``create``, ``sent`` (queued), ``pause``, ``resume`` and ``cancel``; the worker ``claim``s,
``heartbeat``s, writes under ``fence`` and ``finish``es; the reaper ``requeue``s.

    validating_files -> queued -> running -> succeeded | failed | cancelled
    queued -> paused (at once: no worker holds it; its message stays in the broker's line)
    running -> pausing -> paused (the worker saves a checkpoint at the next step and lets go)
    paused -> queued (resume: sent again only if its message was consumed while it was paused)
    pausing -> running (resume before the worker stopped)
    queued | paused -> cancelled; running | pausing -> cancel_requested, then cancelled

Reaching succeeded, failed, cancelled or paused writes the owner's webhook deliveries in the same
transaction (``webhooks.emit``); they are sent once it commits.

A worker owns a running job through its lease (``lease_token``, ``lease_expires``); every write it
makes goes through ``fence``, which locks the job's row while the token still holds, so a worker
that lost the job (its lease expired and another took it) writes nothing into it.
"""

from __future__ import annotations

import time

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from api import webhooks
from api.errors import Conflict
from api.models import TERMINAL_STATES, Job, JobEvent, now

WAITING = ("validating_files", "queued", "paused")  # no worker holds these
HELD = ("running", "pausing")  # a worker holds these through its lease


def _event(s: Session, job_id: str, message: str, level: str = "info", **data) -> None:
    s.add(JobEvent(job_id=job_id, message=message, level=level, data=data or None))


def _moved(s: Session, job_id: str, where, **values) -> bool:
    """One guarded UPDATE: True when the job was in the state ``where`` says and now is not."""
    res = s.execute(update(Job).where(Job.id == job_id, where).values(**values))
    return res.rowcount == 1  # type: ignore[attr-defined]  # an UPDATE's Result is a CursorResult


# ---- the API's transitions --------------------------------------------------------------------
def create(s: Session, job: Job, examples: int | None) -> None:
    """A new job, its files checked (services.create_job): queued once the caller commits."""
    job.status = "validating_files"
    s.add(job)
    s.flush()
    _event(s, job.id, f"Validating training file: {job.training_file}")
    _event(s, job.id, f"Files validated ({examples} examples), moving job to queued state")
    job.status = "queued"


def sent(s: Session, job_id: str, ok: bool) -> None:
    """The job's message went to the broker (or could not: the reaper sends queued jobs that have
    no ``enqueued_at``)."""
    if ok:
        _moved(s, job_id, Job.id == job_id, enqueued_at=time.time())
    else:
        _event(s, job_id, "The queue could not be reached; the job will be sent again shortly", level="warn")


def pause(s: Session, job: Job) -> None:
    """OpenAI's pause: a queued job pauses at once; a running one is asked to (``pausing``) and the
    worker saves a checkpoint and stops at its next step."""
    if job.status in ("paused", "pausing"):
        return
    if _moved(s, job.id, Job.status == "queued", status="paused"):
        _event(s, job.id, "Job paused; it keeps its place in line until resumed")
        webhooks.emit(s, job.id, "paused")
    elif _moved(s, job.id, Job.status == "running", status="pausing"):
        _event(s, job.id, "Pause requested; the job saves a checkpoint and stops at the next step")
    else:
        s.refresh(job)
        raise Conflict(f"Job {job.id} is {job.status} and cannot be paused", code="job_not_pausable")


def resume(s: Session, job: Job) -> bool:
    """Back in line from ``paused`` (True: its message was consumed meanwhile, so send it again),
    or back to ``running`` when the worker has not stopped yet."""
    if _moved(s, job.id, Job.status == "pausing", status="running"):
        _event(s, job.id, "Pause withdrawn; the job keeps running")
        return False
    if _moved(s, job.id, Job.status == "paused", status="queued"):
        _event(s, job.id, "Job resumed; it continues from its last checkpoint")
        s.refresh(job)
        return job.enqueued_at is None
    s.refresh(job)
    raise Conflict(f"Job {job.id} is {job.status}, not paused", code="job_not_paused")


def cancel(s: Session, job: Job) -> None:
    if job.status in TERMINAL_STATES:
        raise Conflict(f"Job {job.id} has already {job.status}", code="job_finished")
    if _moved(s, job.id, Job.status.in_(WAITING), status="cancelled", finished_at=now(), cancel_requested=True):
        _event(s, job.id, "Job cancelled before it ran" if job.status != "paused" else "Paused job cancelled")
        webhooks.emit(s, job.id, "cancelled")
    elif _moved(s, job.id, and_(Job.status.in_(HELD), Job.cancel_requested.is_(False)), cancel_requested=True):
        _event(s, job.id, "Cancellation requested; the job stops at the next step")


# ---- the worker's ----------------------------------------------------------------------------
def claim(s: Session, job_id: str, token: str, lease_seconds: float) -> Job | None:
    """Take the job's lease if nobody holds a live one; the job is then running. None when it is
    not this worker's to run (finished, paused, cancelled, or held)."""
    t = time.time()
    free = or_(Job.lease_expires.is_(None), Job.lease_expires < t)
    if not _moved(
        s,
        job_id,
        and_(Job.status.in_(("queued", "running")), free),
        lease_token=token,
        lease_expires=t + lease_seconds,
        attempt=Job.attempt + 1,
    ):
        # a paused job's message was consumed: resume must send it again
        _moved(s, job_id, Job.status == "paused", enqueued_at=None)
        return None
    job = s.scalar(select(Job).where(Job.id == job_id))
    assert job is not None  # its lease was just taken
    if job.cancel_requested:
        job.status, job.finished_at, job.lease_token = "cancelled", now(), None
        _event(s, job_id, "Job cancelled")
        webhooks.emit(s, job_id, "cancelled")
        return None
    if job.status == "queued" and job.started_at is None:
        _event(s, job_id, "Fine-tuning job started")
    elif job.status == "queued":
        _event(s, job_id, f"Job resumed on a worker (attempt {job.attempt})")
    else:
        _event(s, job_id, f"Worker restarted the job (attempt {job.attempt})")
    job.status = "running"
    job.started_at = job.started_at or now()
    return job


def fence(s: Session, job_id: str, token: str) -> bool:
    """Lock the job's row for this transaction if ``token`` still holds its lease. Every write a
    worker makes runs after this in the same transaction, so none lands once the lease is lost."""
    return _moved(s, job_id, Job.lease_token == token, lease_token=token)


def heartbeat(s: Session, job_id: str, token: str, lease_seconds: float) -> bool:
    return _moved(s, job_id, Job.lease_token == token, lease_expires=time.time() + lease_seconds)


def stop_reason(s: Session, job_id: str, token: str) -> str | None:
    """What the trainer should do at its next step: 'lease_lost', 'cancel', 'pause' or None."""
    row = s.execute(select(Job.status, Job.cancel_requested, Job.lease_token).where(Job.id == job_id)).one()
    if row.lease_token != token:
        return "lease_lost"
    if row.cancel_requested:
        return "cancel"
    return "pause" if row.status == "pausing" else None


def finish(s: Session, job_id: str, token: str, status: str, message: str, level: str = "info", **values) -> bool:
    """The run's end, written once by the worker that holds the lease: ``status`` is succeeded,
    failed, cancelled or paused (the lease is let go; a paused job is sent again on resume)."""
    assert status in (*TERMINAL_STATES, "paused")
    ended = {"finished_at": now()} if status != "paused" else {"enqueued_at": None}
    if not _moved(
        s, job_id, Job.lease_token == token, status=status, lease_token=None, lease_expires=None, **ended, **values
    ):
        return False
    _event(s, job_id, message, level=level)
    webhooks.emit(s, job_id, status)
    return True


# ---- the reaper's ----------------------------------------------------------------------------
def stale(t: float, lease_seconds: float, queued_after: float):
    """Jobs nobody works on: held ones whose lease expired (their worker died), queued ones whose
    message never reached the broker or got lost there."""
    return or_(
        and_(
            Job.status.in_(HELD),
            Job.lease_expires < t,
            or_(Job.enqueued_at.is_(None), Job.enqueued_at < t - lease_seconds),
        ),
        and_(
            Job.status == "queued",
            Job.lease_token.is_(None),
            or_(and_(Job.enqueued_at.is_(None), Job.created_at < t - 5), Job.enqueued_at < t - queued_after),
        ),
    )


def requeue(s: Session, job_id: str, t: float, lease_seconds: float, queued_after: float) -> bool:
    """Claim a stale job for sending again (once per period however many reapers see it); a job
    whose worker died while pausing is paused instead (it resumes from its last checkpoint).
    True: send it."""
    where = stale(t, lease_seconds, queued_after)
    if _moved(s, job_id, and_(where, Job.status == "pausing"), status="paused", lease_token=None, enqueued_at=None):
        _event(s, job_id, "The worker stopped while pausing; the job is paused at its last checkpoint", level="warn")
        webhooks.emit(s, job_id, "paused")
        return False
    status = s.scalar(select(Job.status).where(Job.id == job_id))
    if not _moved(s, job_id, where, enqueued_at=t):
        return False
    if status == "running":
        _event(
            s,
            job_id,
            "The worker stopped responding; the job is queued again and resumes from its last checkpoint",
            level="warn",
        )
    return True
