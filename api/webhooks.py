"""Webhooks, signed in the Standard Webhooks scheme (the one OpenAI's webhooks use).

Every request carries ``webhook-id`` (the delivery's id, the same on every attempt: the receiver's
idempotency key), ``webhook-timestamp`` (the attempt's Unix seconds) and ``webhook-signature``:
``v1,`` and the base64 HMAC-SHA256 of ``{webhook-id}.{webhook-timestamp}.{body}``, keyed with the
base64-decoded part of the endpoint's ``whsec_…`` secret. The body is OpenAI's event,
``{"id": "evt_…", "object": "event", "created_at", "type": "fine_tuning.job.succeeded",
"data": {"id": "ftjob-…"}}``, kept as bytes so every attempt sends the same ones.

How an event travels, at least once:

1. ``emit``: in the transaction that moves a job to succeeded, failed, cancelled or paused
   (api/lifecycle.py), one ``WebhookDelivery`` row per endpoint of the owner that takes the event.
2. Once that transaction commits (a Session ``after_commit`` hook, so a message never names a row
   that is not there), each delivery's id goes to the webhook queue (``api.queue.send_delivery``),
   which a worker of its own consumes (``--pool=threads``): a delivery never waits behind training.
3. ``deliver`` (the task): takes the delivery's lease, posts, records the answer. A 2xx delivers it;
   anything else (redirects included) is retried after an exponential backoff with jitter, with a
   fresh timestamp and signature, until ``webhook_max_attempts``; a 410 Gone stops at once.
4. ``resend_stale`` (the reaper's): a due delivery nobody holds and nobody was sent for
   ``webhook_resend_after_seconds`` is sent again: its message was lost, its commit hook never
   ran, or its sender died mid-attempt (its lease ran out). A sender that outlives its lease (a
   receiver that drip-feeds its answer) may overlap with the next: at least once, not exactly once.

No address is refused (loopback and private ones included): put an egress proxy that filters
internal addresses in front of the webhook worker (HTTPS_PROXY; httpx reads it) where owners are
not trusted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import random
import secrets
import time
from typing import Any, Literal, get_args

import httpx
from sqlalchemy import Select, and_, event, or_, select, update
from sqlalchemy.orm import Session

from api import queue
from api.db import session_scope
from api.errors import not_found
from api.models import Job, WebhookDelivery, WebhookEndpoint, new_id
from api.settings import Settings, get_settings
from kiln.types import WebhookEvent

log = logging.getLogger("kiln.webhooks")

EventType = Literal[
    "fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled", "fine_tuning.job.paused"
]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
_OUTBOX = "kiln.webhook_deliveries"  # Session.info key: deliveries written in the open transaction


# ---- signing ---------------------------------------------------------------------------------
def new_secret() -> str:
    """``whsec_`` and the base64 of 32 random bytes (the scheme asks for 24 to 64)."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header's value: ``v1,<base64 HMAC-SHA256>`` of ``id.timestamp.body``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


# ---- endpoints (the routes') -----------------------------------------------------------------
def create_endpoint(s: Session, owner: str, url: str, events: list[EventType] | None) -> WebhookEndpoint:
    chosen = [t for t in EVENT_TYPES if events is None or t in events]  # in a fixed order, once each
    endpoint = WebhookEndpoint(id=new_id("we_"), owner=owner, url=url, events=chosen, secret=new_secret())
    s.add(endpoint)
    s.flush()
    return endpoint


def endpoints_of(owner: str) -> Select:
    return select(WebhookEndpoint).where(WebhookEndpoint.owner == owner)


def get_endpoint(s: Session, owner: str, endpoint_id: str) -> WebhookEndpoint:
    found = s.scalar(endpoints_of(owner).where(WebhookEndpoint.id == endpoint_id))
    if found is None:
        raise not_found("webhook endpoint", endpoint_id)
    return found


def delete_endpoint(s: Session, owner: str, endpoint_id: str) -> None:
    """The endpoint and its delivery log; a delivery in flight finds nothing to record and stops."""
    s.delete(get_endpoint(s, owner, endpoint_id))


def deliveries_of(endpoint: WebhookEndpoint) -> Select:
    return select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id)


def endpoint_public(e: WebhookEndpoint, with_secret: bool = False) -> dict[str, Any]:
    return {
        "id": e.id,
        "object": "webhook_endpoint",
        "url": e.url,
        "events": e.events,
        "created_at": e.created_at,
        "secret": e.secret if with_secret else None,
    }


def delivery_public(d: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": d.id,
        "object": "webhook_delivery",
        "webhook_id": d.endpoint_id,
        "event_id": d.event_id,
        "event_type": d.event_type,
        "job_id": d.job_id,
        "status": d.status,
        "attempts": d.attempts,
        "last_status_code": d.last_status_code,
        "last_error": d.last_error,
        "last_attempt_at": d.last_attempt_at,
        "next_attempt_at": int(d.next_attempt_at) if d.status == "pending" else None,
        "delivered_at": d.delivered_at,
        "created_at": d.created_at,
    }


# ---- emitting (api/lifecycle.py's) -----------------------------------------------------------
def emit(s: Session, job_id: str, status: str) -> None:
    """The job reached ``status``: a delivery per endpoint of its owner that takes the event, in
    the caller's transaction; sent to the webhook queue once it commits."""
    kind = f"fine_tuning.job.{status}"
    assert kind in EVENT_TYPES
    owner = s.scalar(select(Job.owner).where(Job.id == job_id))
    # FOR KEY SHARE (PostgreSQL): an endpoint deleted meanwhile is not written to, and one being
    # deleted waits for this commit, so the status change never fails on a delivery's foreign key
    found = s.scalars(endpoints_of(owner or "").with_for_update(read=True, key_share=True))
    endpoints = [e for e in found if kind in e.events]
    if not endpoints:
        return
    t = time.time()
    evt = WebhookEvent(id=new_id("evt_"), created_at=int(t), type=kind, data={"id": job_id})
    body = evt.model_dump_json()
    rows = [
        WebhookDelivery(
            id=new_id("msg_"),
            endpoint_id=e.id,
            job_id=job_id,
            event_id=evt.id,
            event_type=kind,
            payload=body,
            next_attempt_at=t,
            sent_at=t,  # as good as sent: if the send after the commit fails, the reaper sends it
        )
        for e in endpoints
    ]
    s.add_all(rows)
    s.info.setdefault(_OUTBOX, []).extend(r.id for r in rows)


@event.listens_for(Session, "after_commit")
def _send_committed(session: Session) -> None:
    for delivery_id in session.info.pop(_OUTBOX, ()):
        queue.send_delivery(delivery_id)  # never raises: a failed send is the reaper's to repeat


@event.listens_for(Session, "after_rollback")
def _forget_rolled_back(session: Session) -> None:
    session.info.pop(_OUTBOX, None)


# ---- delivering (the webhook worker's task) --------------------------------------------------
def post(url: str, secret: str, msg_id: str, body: bytes, timeout: float) -> tuple[int | None, str | None]:
    """One attempt: (status code, error). The answer's body is never read; redirects are not followed."""
    ts = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": "Kiln-Webhooks/1",
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": sign(secret, msg_id, ts, body),
    }
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False) as c,
            c.stream("POST", url, content=body, headers=headers) as r,
        ):
            code = r.status_code
    except Exception as e:  # connection refused, timeouts, an address httpx cannot use
        return None, f"{type(e).__name__}: {e}"[:500]
    return code, None if 200 <= code < 300 else f"HTTP {code}"


def backoff(attempts: int, settings: Settings) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones: doubling, capped, +-10% jitter."""
    base = min(settings.webhook_backoff_seconds * 2 ** (attempts - 1), settings.webhook_backoff_max_seconds)
    return base * random.uniform(0.9, 1.1)


def _claim(s: Session, delivery_id: str, token: str, settings: Settings) -> tuple[str, str, str] | None:
    """Take the delivery for one attempt if it is pending, due and nobody holds it: (url, secret, body)."""
    t, d = time.time(), WebhookDelivery
    res = s.execute(
        update(d)
        .where(
            d.id == delivery_id,
            d.status == "pending",
            d.next_attempt_at <= t + 1,  # a message early by a clock's drift still counts
            or_(d.lease_expires.is_(None), d.lease_expires < t),
        )
        .values(
            lease_token=token,
            lease_expires=t + 2 * settings.webhook_timeout_seconds,  # a connect, then the answer
            attempts=d.attempts + 1,
            last_attempt_at=int(t),
        )
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]  # an UPDATE's Result is a CursorResult
        return None
    row = s.execute(
        select(WebhookEndpoint.url, WebhookEndpoint.secret, d.payload)
        .join(WebhookEndpoint, WebhookEndpoint.id == d.endpoint_id)
        .where(d.id == delivery_id)
    ).one()
    return row.url, row.secret, row.payload


def _record(
    s: Session, delivery_id: str, token: str, code: int | None, error: str | None, settings: Settings
) -> tuple[str, float | None]:
    """What the attempt got: ('delivered' | 'failed' | 'retry' | 'lost', seconds until the retry)."""
    t, d = time.time(), WebhookDelivery
    seen = {"last_status_code": code, "last_error": error}
    if error is None:  # delivered, even if this sender's lease ran out meanwhile
        s.execute(
            update(d)
            .where(d.id == delivery_id, d.status == "pending")
            .values(status="delivered", delivered_at=int(t), lease_token=None, lease_expires=None, **seen)
        )
        return "delivered", None
    attempts = s.scalar(select(d.attempts).where(d.id == delivery_id, d.lease_token == token, d.status == "pending"))
    if attempts is None:  # another sender took it over (or it was delivered, or deleted)
        return "lost", None
    held = and_(d.id == delivery_id, d.lease_token == token, d.status == "pending")
    if attempts >= settings.webhook_max_attempts or code == 410:  # 410 Gone: the receiver wants no more
        s.execute(update(d).where(held).values(status="failed", lease_token=None, lease_expires=None, **seen))
        return "failed", None
    delay = backoff(attempts, settings)
    s.execute(
        update(d).where(held).values(next_attempt_at=t + delay, sent_at=t, lease_token=None, lease_expires=None, **seen)
    )
    return "retry", delay


def deliver(delivery_id: str) -> str:
    """One attempt at a delivery, safe to run twice (the lease lets one sender at a time try it):
    'delivered', 'retry' (sent again after the backoff), 'failed', 'lost' or 'skipped'."""
    settings, token = get_settings(), secrets.token_hex(8)
    with session_scope() as s:
        claimed = _claim(s, delivery_id, token, settings)
    if claimed is None:
        return "skipped"  # delivered, given up, not due yet, held by another sender, or deleted
    url, secret, body = claimed
    code, error = post(url, secret, delivery_id, body.encode(), settings.webhook_timeout_seconds)
    with session_scope() as s:
        outcome, retry_in = _record(s, delivery_id, token, code, error, settings)
    if retry_in is not None:
        queue.send_delivery(delivery_id, countdown=retry_in)
    log.info("webhook delivery %s: %s (%s)", delivery_id, outcome, error or code)
    return outcome


# ---- the reaper's ----------------------------------------------------------------------------
def resend_stale(limit: int = 500) -> list[str]:
    """Send again the pending deliveries that are due, held by no sender, and were last sent
    ``webhook_resend_after_seconds`` ago or more; once per period however many reapers see them."""
    settings, t, d = get_settings(), time.time(), WebhookDelivery
    ago = t - settings.webhook_resend_after_seconds
    stale = and_(
        d.status == "pending",
        or_(d.lease_expires.is_(None), d.lease_expires < t),
        d.next_attempt_at < ago,
        d.sent_at < ago,
    )
    with session_scope() as s:
        candidates = list(s.scalars(select(d.id).where(stale).order_by(d.pk).limit(limit)))
    sent = []
    for delivery_id in candidates:
        with session_scope() as s:
            res = s.execute(update(d).where(d.id == delivery_id, stale).values(sent_at=t))
            if res.rowcount != 1:  # type: ignore[attr-defined]  # another reaper took it
                continue
        if queue.send_delivery(delivery_id):
            sent.append(delivery_id)
    return sent
