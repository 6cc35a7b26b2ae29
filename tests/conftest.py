from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

# the stack (the service's packages: psycopg, the API) is imported by the fixtures that start
# one, so that tests/gpu runs where only torch is (the GPU machines)

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample"


@pytest.fixture(scope="session")
def sample() -> Path:
    return SAMPLE


@pytest.fixture(scope="module")
def make_pg_stack(tmp_path_factory):
    """Start stacks in the production layout (PostgreSQL + Redis), each on a fresh database,
    with settings of the test's choosing; all stopped and dropped when the module ends."""
    from tests.stack import REDIS_URL, Stack, create_pg_database, drop_pg_database

    made = []

    def make(broker_url: str = REDIS_URL, workers: int = 1, home: Path | None = None, **settings) -> Stack:
        name, url = create_pg_database()
        stack = Stack(home or tmp_path_factory.mktemp("pg"), url, broker_url, **settings)
        made.append((stack, name))
        return stack.start(workers)

    yield make
    for stack, name in made:
        stack.stop()
        drop_pg_database(name)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) for the session; each test takes a fresh bucket of it."""
    from tests.stack import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pg_stack(make_pg_stack):
    return make_pg_stack(max_upload_bytes=2_000_000)


@pytest.fixture(scope="module")
def sqlite_stack(tmp_path_factory):
    """Embedded defaults: SQLite and Celery over SQLite, no server but ours."""
    from tests.stack import Stack

    home = tmp_path_factory.mktemp("embedded")
    stack = Stack(home, f"sqlite:///{home / 'kiln.sqlite'}", f"sqla+sqlite:///{home / 'broker.sqlite'}")
    try:
        yield stack.start()
    finally:
        stack.stop()


def wait_for(predicate, timeout: float = 120, interval: float = 0.3, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (ended: gone, or a zombie its parent has not reaped yet;
    a pool's own thread may reap it, so Process.join in a test can race it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def unique() -> str:
    return uuid.uuid4().hex[:8]


def all_events(c, job_id: str) -> list[dict]:
    """Every event of a job (newest first), following the cursor."""
    out, after = [], None
    while True:
        params = {"limit": 100, **({"after": after} if after else {})}
        page = c.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params).json()
        out += page["data"]
        if not page["has_more"]:
            return out
        after = page["data"][-1]["id"]


def finished(c, job_id: str, timeout: float = 240) -> dict:
    """Wait until the job has ended; return it."""
    return wait_for(
        lambda: (
            (j := c.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] in ("succeeded", "failed", "cancelled")
            and j
        ),
        timeout=timeout,
        what=f"{job_id} to finish",
    )
