"""Infrastructure faults while jobs run: Redis restarted, PostgreSQL connections dropped, the
store's disk full during an upload."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from tests.conftest import all_events, finished, wait_for
from tests.stack import PG_ADMIN, free_port

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


class Redis:
    """A private redis-server, so restarting it disturbs nothing else on the machine."""

    def __init__(self, workdir: Path):
        self.port, self.dir = free_port(), workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(
            lambda: (
                subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout.strip()
                == b"PONG"
            ),
            timeout=20,
            what="redis",
        )

    def kill(self) -> None:
        assert self.proc is not None, "kill before start"
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def dataset(sample):
    return {"train.jsonl": (sample / "train.jsonl").read_bytes(), "images.zip": (sample / "images.zip").read_bytes()}


def upload_dataset(c, dataset):
    ids = {
        n: c.post("/v1/files", files={"file": (n, b)}, data={"purpose": "fine-tune"}).json()["id"]
        for n, b in dataset.items()
    }
    return {"training_file": ids["train.jsonl"], "images_file": ids["images.zip"]}


def test_redis_restart_mid_job(make_pg_stack, dataset, tmp_path):
    redis = Redis(tmp_path)
    redis.start()
    stack = make_pg_stack(broker_url=redis.url)
    try:
        with stack.client() as c:
            files = upload_dataset(c, dataset)
            first = c.post(
                "/v1/fine_tuning/jobs",
                json={"model": "kiln-tiny", **files, "hyperparameters": {"n_epochs": 2, "batch_size": 4}},
            ).json()
            wait_for(lambda: any(e["type"] == "metrics" for e in all_events(c, first["id"])), what="training to start")
            redis.kill()  # Redis keeps nothing on disk: every queued message is gone with it
            t0 = time.time()
            second = c.post(
                "/v1/fine_tuning/jobs",
                json={"model": "kiln-tiny", **files, "hyperparameters": {"n_epochs": 1, "batch_size": 16}},
            )
            assert second.status_code == 200 and time.time() - t0 < 15  # accepted while the broker is down
            second = second.json()
            assert second["status"] == "queued"
            assert any(
                e["level"] == "warn" and "queue could not be reached" in e["message"]
                for e in all_events(c, second["id"])
            )
            time.sleep(2)
            redis.start()
            done = finished(c, first["id"])
            assert done["status"] == "succeeded", done["error"]
            assert sorted(e["data"]["step"] for e in all_events(c, first["id"]) if e["type"] == "metrics") == list(
                range(1, 121)
            )
            done = finished(c, second["id"])  # the reaper sent it once Redis was back
            assert done["status"] == "succeeded", done["error"]
            third = c.post(
                "/v1/fine_tuning/jobs",
                json={"model": "kiln-tiny", **files, "hyperparameters": {"n_epochs": 1, "batch_size": 16}},
            ).json()
            assert finished(c, third["id"])["status"] == "succeeded"
    finally:
        stack.stop()
        redis.kill()


def terminate_connections(dbname: str) -> int:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    return len(rows)


def test_postgres_connections_dropped_mid_job(make_pg_stack, dataset):
    stack = make_pg_stack()
    dbname = stack.env["KILN_DATABASE_URL"].rsplit("/", 1)[1]
    with stack.client() as c:
        files = upload_dataset(c, dataset)
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-tiny",
                **files,
                "hyperparameters": {"n_epochs": 2, "batch_size": 4, "checkpoint_interval": 10},
            },
        ).json()
        wait_for(lambda: any(e["type"] == "metrics" for e in all_events(c, job["id"])), what="training to start")
        dropped = 0
        for _ in range(4):
            dropped += terminate_connections(dbname)
            assert c.get(f"/v1/fine_tuning/jobs/{job['id']}").status_code == 200  # the API reconnects at once
            time.sleep(1.0)
        assert dropped >= 4
        done = finished(c, job["id"])
        assert done["status"] == "succeeded" and done["attempt"] == 1, done["error"]
        metrics = sorted(e["data"]["step"] for e in all_events(c, job["id"]) if e["type"] == "metrics")
        assert metrics == list(range(1, 121))


@pytest.fixture
def small_disk():
    folder = Path(tempfile.mkdtemp(prefix="kiln-disk-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)])
    folder.rmdir()


def test_disk_full_during_upload_keeps_nothing(make_pg_stack, small_disk):
    stack = make_pg_stack(workers=0, store_dir=str(small_disk / "store"), max_upload_bytes=50_000_000)
    line = (json.dumps(GOOD) + "\n").encode()
    with stack.client() as c:
        r = c.post("/v1/files", files={"file": ("big.jsonl", line * 100_000)}, data={"purpose": "fine-tune"})  # 7 MB
        assert r.status_code == 507, r.text
        assert "No space left on device" in r.json()["error"]["message"]
        assert [p for p in (small_disk / "store").rglob("*") if p.is_file()] == []
        assert c.get("/v1/files").json()["data"] == []
        ok = c.post("/v1/files", files={"file": ("small.jsonl", line * 10)}, data={"purpose": "fine-tune"})
        assert ok.status_code == 200  # the service carries on once there is room
