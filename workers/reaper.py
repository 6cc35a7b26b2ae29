"""Re-send jobs nobody is working on (``api.lifecycle.stale``): running jobs whose lease expired
(their worker died) and queued jobs whose message never reached the broker or got lost there; a
job whose worker died while pausing is paused. It also re-sends webhook deliveries that are due and
that no sender took (``api.webhooks.resend_stale``: never sent, message lost, sender died).

Every worker runs one; the guarded UPDATE makes sure a job is re-sent once per period however
many reapers see it.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import select, update

from api import lifecycle, queue, webhooks
from api.db import session_scope
from api.models import Job
from api.settings import get_settings

log = logging.getLogger("kiln.reaper")


def reap_once() -> list[str]:
    settings, t = get_settings(), time.time()
    args = (t, settings.lease_seconds, settings.requeue_queued_after_seconds)
    sent = []
    with session_scope() as s:
        candidates = list(s.scalars(select(Job.id).where(lifecycle.stale(*args))))
    for job_id in candidates:
        with session_scope() as s:
            if not lifecycle.requeue(s, job_id, *args):
                continue
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
            try:
                for delivery_id in webhooks.resend_stale():
                    log.warning("re-sent webhook delivery %s", delivery_id)
            except Exception:
                log.exception("webhook reaper pass failed")
