"""The export's service side, torch-free: api/exports.py's states in the store (who may take an
export, what a stopped heartbeat or a lost archive shows as, a new attempt's clean outcome), and
the SDK and CLI against a scripted server (a failed export, --no-wait)."""

from __future__ import annotations

import time

import httpx
import pytest

from api import exports
from api.settings import get_settings
from kiln import KilnError
from kiln import cli as kiln_cli
from kiln.client import Client
from kiln.store import LocalStore

JOB = "ftjob-abc"


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path)


def test_one_worker_takes_it_and_a_second_does_not(store):
    assert exports.claim(store, JOB, "w1")
    state = exports.read(store, JOB)
    assert state is not None and state["status"] == "running" and state["token"] == "w1"
    assert not exports.claim(store, JOB, "w2")  # its heartbeat is fresh
    assert exports.beat(store, JOB, "w1") and not exports.beat(store, JOB, "w2")


def test_a_stopped_heartbeat_is_failed_and_taken_again(store):
    assert exports.claim(store, JOB, "w1")
    state = exports.read(store, JOB)
    assert state is not None
    exports.write(store, JOB, {**state, "heartbeat_at": time.time() - get_settings().lease_seconds - 1})
    shown = exports.status(store, exports.read(store, JOB) or {})
    assert shown["status"] == "failed" and shown["error"]["code"] == "worker_lost"
    assert exports.claim(store, JOB, "w2")  # a redelivered message, or a new POST's task
    assert not exports.beat(store, JOB, "w1")  # the first worker lets go at its next beat


def test_finished_is_left_alone_until_its_archive_goes(store):
    assert exports.claim(store, JOB, "w1")
    with store.publish_file(exports.archive_key(JOB)) as path:
        path.write_bytes(b"zip")
    exports.finish(store, JOB, "w1", status="succeeded", bytes=3, model_type="kiln_tiny", dtypes=["float32"])
    state = exports.read(store, JOB)
    assert state is not None and exports.status(store, state)["status"] == "succeeded" and state["error"] is None
    assert not exports.claim(store, JOB, "w2") and not exports.beat(store, JOB, "w1")
    store.path(exports.archive_key(JOB)).unlink()
    shown = exports.status(store, state)
    assert shown["status"] == "failed" and shown["error"]["code"] == "archive_missing"
    assert exports.claim(store, JOB, "w2")


def test_a_new_attempt_clears_the_last_error(store):
    assert exports.claim(store, JOB, "w1")
    exports.finish(store, JOB, "w1", status="failed", error={"code": "export_error", "message": "x", "param": None})
    assert exports.claim(store, JOB, "w2")
    exports.finish(store, JOB, "w2", status="succeeded", bytes=1)
    state = exports.read(store, JOB)
    assert state is not None and state["status"] == "succeeded" and state["error"] is None


def scripted(states: list[str], seen: list[str]) -> Client:
    """A client whose server answers the export's requests with ``states`` in turn (the last one
    again once they run out) and a zip for the content."""
    answers = iter(states)
    last = states[-1]

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal last
        seen.append(f"{request.method} {request.url.raw_path.decode()}")
        if request.url.path.endswith("/content"):
            return httpx.Response(200, content=b"PK-zip")
        last = next(answers, last)
        error = {"code": "export_error", "message": "ValueError: no room", "param": None} if last == "failed" else None
        body = {
            "id": "export-1",
            "model": "ft:kiln-tiny:alice::1",
            "base_model": "kiln-tiny",
            "fine_tuning_job_id": "ftjob-1",
            "status": last,
            "created_at": 1,
            "error": error,
        }
        return httpx.Response(202 if request.method == "POST" else 200, json=body)

    return Client("http://kiln.test", "sk-test", http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def test_the_sdk_waits_then_downloads_and_a_failure_raises_its_reason(tmp_path) -> None:
    seen: list[str] = []
    with scripted(["queued", "running", "succeeded"], seen) as client:
        path = client.exports.download("ft:kiln-tiny:alice::1", tmp_path / "m.zip")
    assert path.read_bytes() == b"PK-zip" and not (tmp_path / "m.zip.part").exists()
    model = "/v1/models/ft:kiln-tiny:alice::1/export"
    assert seen == [f"POST {model}", f"GET {model}", f"GET {model}", f"GET {model}/content"]
    with scripted(["running", "failed"], []) as client, pytest.raises(KilnError, match="failed: ValueError: no room"):
        client.exports.download("ft:kiln-tiny:alice::1", tmp_path / "n.zip")
    assert not (tmp_path / "n.zip").exists()


def test_the_cli_exits_1_on_a_failed_export_and_only_starts_with_no_wait(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = kiln_cli.Out(False)
    with scripted(["failed"], []) as client:
        args = kiln_cli._parser().parse_args(["export", "ft:kiln-tiny:alice::1"])
        assert kiln_cli._export(client, args, out) == 1
    assert "export-1  failed  ValueError: no room" in capsys.readouterr().out
    seen: list[str] = []
    with scripted(["queued"], seen) as client:
        args = kiln_cli._parser().parse_args(["export", "ft:kiln-tiny:alice::1", "--no-wait"])
        assert kiln_cli._export(client, args, out) == 0
    assert "export-1  queued" in capsys.readouterr().out
    assert seen == ["POST /v1/models/ft:kiln-tiny:alice::1/export"] and not list(tmp_path.iterdir())
