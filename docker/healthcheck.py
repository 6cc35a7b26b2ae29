"""The images' health checks (HEALTHCHECK, compose's healthcheck), standard library only:

- ``healthcheck.py http URL``: healthy when URL answers 2xx within 4 s (the API's /healthz, the
  inference server's /healthz, SeaweedFS's S3 /healthz).
- ``healthcheck.py worker``: healthy when a Celery worker process is alive in the container and
  the broker (``KILN_BROKER_URL``) accepts a connection. Not ``celery inspect ping``: a training
  worker runs the solo pool, which answers no remote-control message while a job trains, so a
  ping would call a busy worker unhealthy.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit


def http(url: str) -> None:
    with urllib.request.urlopen(url, timeout=4) as r:
        if not 200 <= r.status < 300:
            raise SystemExit(f"{url}: {r.status}")


def worker() -> None:
    alive = False
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"celery") for a in argv[:2]) and b"worker" in argv:
                alive = True
                break
    if not alive:
        raise SystemExit("no celery worker process")
    broker = os.environ.get("KILN_BROKER_URL", "")
    if not broker.startswith(("redis://", "rediss://", "amqp://")):
        return  # the embedded broker is a file: nothing to reach
    u = urlsplit(broker)
    default = 5672 if u.scheme == "amqp" else 6379
    with socket.create_connection((u.hostname or "localhost", u.port or default), timeout=3) as s:
        if u.scheme.startswith("redis"):
            s.sendall(b"PING\r\n")  # a server that wants AUTH answers -NOAUTH: still up
            if not s.recv(64):
                raise SystemExit(f"{u.hostname}: no answer")


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["http"] and len(sys.argv) == 3:
            http(sys.argv[2])
        elif sys.argv[1:] == ["worker"]:
            worker()
        else:
            raise SystemExit("usage: healthcheck.py http URL | worker")
    except (OSError, ValueError) as e:
        raise SystemExit(f"unhealthy: {e}") from None
