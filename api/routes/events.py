"""Live job events as Server-Sent Events.

Each event is ``id: <cursor>``, ``event: message|metrics|status``, ``data: <event JSON>``. A client
that reconnects with ``Last-Event-ID`` continues where it stopped; the stream ends with an
``end`` event once the job has finished and every event was sent, or with a ``shutdown`` event
when the server stops (reconnect with ``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from fastapi import Depends, Header, Query
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import services
from api.auth import current_owner
from api.db import get_sessionmaker
from api.deps import Router, get_session
from api.errors import responses
from api.models import TERMINAL_STATES, Job
from api.schemas import event_public
from api.settings import get_settings

router = Router(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
log = logging.getLogger("kiln.api")
MAX_CURSOR = 2**31 - 1  # event pks are 32-bit integers
# Set when the server is told to stop (api.app installs the signal hook): every open stream ends
# at its next poll, so a clean shutdown does not wait for running jobs; clients reconnect with
# Last-Event-ID, to this server once it is back or to another.
SHUTTING_DOWN = threading.Event()


def _poll(job_id: str, cursor: int) -> tuple[list, str | None]:
    with get_sessionmaker()() as session:
        events = services.events_since(session, job_id, cursor)
        return events, session.scalar(select(Job.status).where(Job.id == job_id))


async def _frames(job_id: str, cursor: int):
    """Async, so an open stream holds no worker thread while it waits; each poll is one short
    query in the threadpool."""
    settings = get_settings()
    last_status, last_sent = None, time.monotonic()
    yield "retry: 2000\n\n"
    while True:
        try:
            events, status = await run_in_threadpool(_poll, job_id, cursor)
        except Exception:  # the response has started: say so in the stream, then end it cleanly
            log.exception("event stream of %s failed", job_id)
            failed = {"id": job_id, "message": "the event stream failed; reconnect"}
            yield f"event: error\ndata: {json.dumps(failed)}\n\n"
            return
        for e in events:
            cursor = e.pk
            yield f"id: {e.pk}\nevent: {e.type}\ndata: {json.dumps(event_public(e))}\n\n"
        if status != last_status:
            last_status = status
            yield f"event: status\ndata: {json.dumps({'id': job_id, 'status': status})}\n\n"
        if events:
            last_sent = time.monotonic()
            continue  # drain a backlog before sleeping
        if status in TERMINAL_STATES:
            yield f"event: end\ndata: {json.dumps({'id': job_id, 'status': status})}\n\n"
            return
        if SHUTTING_DOWN.is_set():
            yield f"event: shutdown\ndata: {json.dumps({'id': job_id, 'reconnect': True})}\n\n"
            return
        if time.monotonic() - last_sent > settings.sse_keepalive_seconds:
            last_sent = time.monotonic()
            yield ": keep-alive\n\n"
        await asyncio.sleep(settings.sse_poll_seconds)


@router.get(
    "/{job_id}/events/stream",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events until the job ends"},
        **responses(404),
    },
)
def stream_events(
    job_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    last_event_id: str | None = Header(None, alias="Last-Event-ID"),
    after: int = Query(0, ge=0),
):
    job = services.get_job(session, owner, job_id)
    cursor = int(last_event_id) if last_event_id and last_event_id.isdigit() else after
    cursor = min(cursor, MAX_CURSOR)  # past every event: nothing old, only what comes next
    session.close()
    return StreamingResponse(
        _frames(job.id, cursor),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
