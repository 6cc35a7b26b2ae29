"""Structured logs: one JSON object a line on stderr, for the API, the workers and the inference
server alike.

Every line has ``ts``, ``level``, ``logger`` and ``msg``, and what is known of the work it belongs
to: ``request_id`` (the API's, also sent back in the ``x-request-id`` header and in error bodies),
``owner_id`` (the API key's owner and the key's id, never the key), ``job_id`` (a route's
``{job_id}``, a worker's job). ``KILN_LOG_FORMAT=text`` writes the same fields as plain text.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

# What the current request or job is. The API's middleware puts a fresh dict here for each request
# (its own task); code below it fills the dict in (``bind``), so a field learnt inside a route's
# worker thread (where a ContextVar set would not travel back) still reaches the access line.
CONTEXT: ContextVar[dict[str, Any] | None] = ContextVar("kiln_log_context", default=None)
FIELDS = ("request_id", "owner_id", "key_id", "job_id")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def bind(**fields: Any) -> None:
    """Add fields to the current request's or job's context (nothing when there is none)."""
    ctx = CONTEXT.get()
    if ctx is not None:
        ctx.update({k: v for k, v in fields.items() if v is not None})


@contextmanager
def context(**fields: Any) -> Iterator[dict[str, Any]]:
    """A context of its own for a stretch of work (a worker's job)."""
    token = CONTEXT.set({k: v for k, v in fields.items() if v is not None})
    try:
        yield CONTEXT.get() or {}
    finally:
        CONTEXT.reset(token)


def current() -> dict[str, Any]:
    """The context's fields: a request's job id comes from its route's path."""
    ctx = CONTEXT.get() or {}
    out = {k: ctx[k] for k in FIELDS if ctx.get(k) is not None}
    scope = ctx.get("scope")
    if scope is not None and "job_id" not in out:
        job = (scope.get("path_params") or {}).get("job_id")
        if job:
            out["job_id"] = job
    return out


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    """The fields given as logging's ``extra=`` (a job created, a request's status and duration)."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **current(),
        }
        line.update(_extra(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = {**current(), **_extra(record)}
        text = super().format(record)
        return text + "".join(f" {k}={v}" for k, v in fields.items())


def configure(fmt: str = "json", level: int = logging.INFO) -> None:
    """Send every logger (uvicorn's and Celery's included) through one stderr handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    # a plain stream handler (basicConfig's, or ours from an earlier call) gives way; others
    # (a test runner's capture) stay
    root.handlers[:] = [h for h in root.handlers if type(h) is not logging.StreamHandler] + [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "celery", "celery.task", "celery.worker"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    # the API writes its own access line (api/observe.py), with the request id and the route
    logging.getLogger("uvicorn.access").disabled = True
