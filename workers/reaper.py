"""Re-send jobs nobody is working on: running jobs whose lease expired (their worker died) and
queued jobs whose message never reached the broker or got lost there.

Every worker runs one; the guarded UPDATE makes sure a job is re-sent once per period however
many reapers see it.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import and_, or_, select, update

from api import queue
from api.db import session_scope
from api.models import Job, JobEvent
from api.settings import get_settings

log = logging.getLogger("kiln.reaper")


def reap_once() -> list[str]:
    settings, t = get_settings(), time.time()
    stale = or_(
        and_(
            Job.status == "running",
            Job.lease_expires < t,
            or_(Job.enqueued_at.is_(None), Job.enqueued_at < t - settings.lease_seconds),
        ),
        and_(
            Job.status == "queued",
            Job.lease_token.is_(None),
            or_(
                and_(Job.enqueued_at.is_(None), Job.created_at < t - 5),
                Job.enqueued_at < t - settings.requeue_queued_after_seconds,
            ),
        ),
    )
    sent = []
    with session_scope() as s:
        candidates = list(s.scalars(select(Job.id).where(stale)))
    for job_id in candidates:
        with session_scope() as s:
            res = s.execute(update(Job).where(Job.id == job_id, stale).values(enqueued_at=t))
            if res.rowcount != 1:  # type: ignore[attr-defined]  # an UPDATE's Result is a CursorResult
                continue
            status = s.scalar(select(Job.status).where(Job.id == job_id))
            if status == "running":
                s.add(
                    JobEvent(
                        job_id=job_id,
                        level="warn",
                        message="The worker stopped responding; the job is queued again and resumes from "
                        "its last checkpoint",
                    )
                )
        if queue.enqueue(job_id):
            sent.append(job_id)
        else:
            with session_scope() as s:  # try again on the next pass
                s.execute(update(Job).where(Job.id == job_id).values(enqueued_at=None))
    return sent


class Reaper(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True, name="kiln-reaper")
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(get_settings().reaper_seconds):
            try:
                for job_id in reap_once():
                    log.warning("re-sent job %s", job_id)
            except Exception:
                log.exception("reaper pass failed")
