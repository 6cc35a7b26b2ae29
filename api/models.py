"""ORM models. The schema itself is created only by the Alembic migrations in migrations/.

Every table has an integer ``pk`` (insertion order, used for cursors) and, where the API shows
it, a public string ``id`` with the OpenAI prefix. Times are Unix seconds.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TERMINAL_STATES = ("succeeded", "failed", "cancelled")  # the statuses and their transitions: api/lifecycle.py


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    __tablename__ = "api_keys"
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("key_"))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(16))  # shown to the owner to tell keys apart
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    revoked_at: Mapped[int | None] = mapped_column(Integer, nullable=True)


class File(Base):
    __tablename__ = "files"
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("file-"))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(50))
    kind: Mapped[str] = mapped_column(String(10))  # jsonl | zip
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)  # the object's key in the store
    status: Mapped[str] = mapped_column(String(20), default="processed")
    status_details: Mapped[str | None] = mapped_column(Text, nullable=True)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    deleted_at: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftjob-"))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    model: Mapped[str] = mapped_column(String(200))
    training_file: Mapped[str] = mapped_column(String(40))
    validation_file: Mapped[str | None] = mapped_column(String(40), nullable=True)
    images_file: Mapped[str | None] = mapped_column(String(40), nullable=True)
    status: Mapped[str] = mapped_column(String(20), default="validating_files", index=True)
    # as resolved (kiln.spec.resolve: every default filled from the model's card; the trainer
    # writes its choices for OpenAI's "auto" three here) and, kept apart, as the request gave them
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    lora: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    requested: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # {"hyperparameters", "lora"}
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seed: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(300), nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    adapter_key: Mapped[str | None] = mapped_column(String(300), nullable=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    started_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    finished_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Worker coordination: cancel is a flag the trainer reads between steps; the lease makes
    # sure one worker at a time trains a job even when the broker delivers its message twice.
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    lease_token: Mapped[str | None] = mapped_column(String(40), nullable=True)
    lease_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    enqueued_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # what the run measured, for the dataset report's time estimate (api/estimate.py)
    worker_kind: Mapped[str | None] = mapped_column(String(100), nullable=True)  # "cpu", the GPU's name
    run_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)  # the worker's wall time, all attempts


class JobEvent(Base):
    __tablename__ = "job_events"
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftevent-"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    level: Mapped[str] = mapped_column(String(10), default="info")
    type: Mapped[str] = mapped_column(String(10), default="message")  # message | metrics
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)  # metrics: the step (one event per step)
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftckpt_"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    store_key: Mapped[str] = mapped_column(String(300))
    created_at: Mapped[int] = mapped_column(Integer, default=now)


class IdempotencyRecord(Base):
    """The answer to a POST sent with an ``Idempotency-Key``, bound to the request's fingerprint
    (sha256 of method, path, owner and body): the same key with another request is a 409. Kept
    24 hours (``expires_at``), then the key may be used again."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("owner", "key", "endpoint"),)
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    key: Mapped[str] = mapped_column(String(300))
    endpoint: Mapped[str] = mapped_column(String(300))
    fingerprint: Mapped[str] = mapped_column(String(64), default="")
    status_code: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    expires_at: Mapped[int] = mapped_column(Integer, default=lambda: now() + 24 * 3600, index=True)


class WebhookEndpoint(Base):
    """Where an owner's job events go (api/webhooks.py). ``secret`` is the Standard Webhooks signing
    secret, ``whsec_`` and the base64 of its 32 random bytes; shown once, when it is made."""

    __tablename__ = "webhook_endpoints"
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("we_"))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[str]] = mapped_column(JSON)  # the event types it takes
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[int] = mapped_column(Integer, default=now)


class WebhookDelivery(Base):
    """One event for one endpoint, written in the transaction that changed the job's status, and
    its delivery log. ``id`` is the ``webhook-id`` header, the same on every attempt; ``payload`` is
    the exact body. A sender holds it through its lease while an attempt runs; ``sent_at`` is when
    its message last went to the broker (the reaper re-sends a due delivery nobody took)."""

    __tablename__ = "webhook_deliveries"
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("msg_"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    event_id: Mapped[str] = mapped_column(String(40))
    event_type: Mapped[str] = mapped_column(String(100))
    payload: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(20), default="pending", index=True)  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    sent_at: Mapped[float] = mapped_column(Float)
    lease_token: Mapped[str | None] = mapped_column(String(40), nullable=True)
    lease_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_attempt_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    delivered_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
