"""What the API tells its operator: a request id on every request (``x-request-id``, taken from
the client when it sends a sane one), one JSON access line per request (api/logs.py), and
Prometheus metrics at ``/metrics``: requests by route and status, latency by route, jobs by
status and the queue's depth (read from the database when scraped).

Each API process counts its own requests: scrape every process (one per container). ``/metrics``
shows counts only, no owner's data; ``KILN_METRICS_TOKEN`` makes it ask for that bearer token.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from api import logs
from api.errors import ApiError

log = logging.getLogger("kiln.access")
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "kiln_http_requests",
    "HTTP requests answered, by route and status",
    ["method", "route", "status"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "kiln_http_request_duration_seconds",
    "Time to the end of the response, by route (an event stream lasts as long as its job)",
    ["method", "route"],
    registry=REGISTRY,
)


class JobsCollector(Collector):
    """Jobs by status and the queue's depth, counted in the database at each scrape."""

    def collect(self) -> Iterable[Metric]:
        from api.db import session_scope
        from api.models import Job

        up = GaugeMetricFamily("kiln_database_up", "1 when the last scrape could read the database")
        try:
            with session_scope() as s:
                rows = s.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        except Exception:
            log.warning("metrics: the database did not answer", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily("kiln_jobs", "Fine-tuning jobs by status (all owners)", labels=["status"])
        counts = dict(rows)
        for status, n in sorted(counts.items()):
            jobs.add_metric([status], n)
        yield jobs
        yield GaugeMetricFamily(
            "kiln_queue_depth", "Jobs queued and waiting for a worker", value=counts.get("queued", 0)
        )


REGISTRY.register(JobsCollector())


class Observe:
    """Pure ASGI middleware (event streams pass through untouched): the request id, the access
    line and the request metrics."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        asked = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = asked if _SANE_ID.fullmatch(asked) else "req_" + secrets.token_hex(12)
        ctx = {"request_id": rid, "scope": scope}
        logs.CONTEXT.set(ctx)  # each request runs in a task of its own: nothing to reset
        status, t0 = 500, time.perf_counter()

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):  # error bodies set it too
                    message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - t0
            route = getattr(scope.get("route"), "path", None) or "unmatched"  # a template: bounded labels
            if route != "/metrics":
                REQUESTS.labels(scope["method"], route, str(status)).inc()
                LATENCY.labels(scope["method"], route).observe(seconds)
                log.log(
                    logging.DEBUG if route == "/healthz" else logging.INFO,  # probes every few seconds
                    "%s %s %s",
                    scope["method"],
                    scope["path"],
                    status,
                    extra={"status": status, "route": route, "duration_ms": round(seconds * 1000, 1)},
                )


def install(app: FastAPI, token: str) -> None:
    app.add_middleware(Observe)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        if token and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            raise ApiError(401, "/metrics needs 'Authorization: Bearer <KILN_METRICS_TOKEN>'", code="invalid_api_key")
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
