"""The kiln SDK and CLI against the real server; retries against a real flaky HTTP server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kiln
from tests.stack import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client(pg_stack):
    with kiln.Client(pg_stack.base_url, pg_stack.keys["alice"], backoff=0.05) as c:
        yield c


def test_sdk_full_path(client, sample, tmp_path):
    seen = []
    train = client.files.upload(sample / "train.jsonl", progress=lambda sent, total: seen.append((sent, total)))
    assert seen and seen[-1] == (train.bytes, train.bytes) and train.stats["examples"] == 240
    images = client.files.upload(sample / "images.zip")
    job = client.jobs.create(
        "kiln-tiny", train.id, images_file=images.id, hyperparameters={"n_epochs": 1}, lora={"rank": 2}, suffix="sdk"
    )
    events = []
    done = client.jobs.wait(job.id, on_event=events.append)
    assert done.status == "succeeded" and done.done and done.fine_tuned_model.endswith(done.id[6:18])
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps == list(range(1, 31))
    history = client.jobs.events(job.id)
    assert (
        history[0].message.startswith("Validating training file")
        and history[-1].message == "The job has successfully completed"
    )
    assert [c.step_number for c in client.jobs.checkpoints(job.id)] == [30]
    path = client.adapters.download(job.id, tmp_path / "a.zip")
    assert "adapter_model.safetensors" in zipfile.ZipFile(path).namelist() and not (tmp_path / "a.zip.part").exists()
    assert done.fine_tuned_model in [m.id for m in client.models.list()]
    assert job.id in [j.id for j in client.jobs.list(limit=1)]  # iterating walks every page


def test_sdk_errors_carry_the_server_message(client, pg_stack, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}\n')
    with pytest.raises(kiln.BadRequestError) as e:
        client.files.upload(bad)
    assert e.value.status_code == 400 and e.value.issues[0] == {
        "line": 1,
        "field": "messages[1].content",
        "message": "empty assistant turn",
    }
    with pytest.raises(kiln.NotFoundError, match="No fine-tuning job found"):
        client.jobs.get("ftjob-missing")
    with (
        kiln.Client(pg_stack.base_url, "sk-kiln-wrong", max_retries=0) as other,
        pytest.raises(kiln.AuthenticationError),
    ):
        other.jobs.list()


def test_keys_create_list_revoke(client, pg_stack):
    new = client.keys.create("ci")
    assert new.secret.startswith("sk-kiln-") and new.prefix == new.secret[:12]
    assert new.id in [k.id for k in client.keys.list()]
    with kiln.Client(pg_stack.base_url, new.secret) as c2:
        assert c2.keys.list()
        with kiln.Client(pg_stack.base_url, pg_stack.keys["bob"]) as bob, pytest.raises(kiln.NotFoundError):
            bob.keys.revoke(new.id)
        assert client.keys.revoke(new.id).revoked_at
        with pytest.raises(kiln.AuthenticationError):
            c2.keys.list()


class Flaky(BaseHTTPRequestHandler):
    """Answers 503 to the first ``fail`` requests of a path, then 200; remembers idempotency keys."""

    log: list = []
    fail = 2

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.log.append((self.path, self.headers.get("idempotency-key")))
        tries = sum(1 for p, _ in self.log if p == self.path)
        if self.path == "/v1/keys" and tries <= self.fail:
            return self._send(503, {"error": {"message": "busy"}})
        if self.path == "/final":
            return self._send(400, {"error": {"message": "no"}}, {"x-should-retry": "false"})
        self._send(200, {"id": "key_1", "name": "x", "prefix": "sk-kiln-abcd", "created_at": 1})

    def _send(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"content-type": "application/json", "content-length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_retries_with_backoff_keep_one_idempotency_key():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with kiln.Client(f"http://127.0.0.1:{server.server_port}", "k", backoff=0.01) as c:
            assert c.keys.create("x").id == "key_1"
            keys = [k for p, k in Flaky.log if p == "/v1/keys"]
            assert len(keys) == 3 and len(set(keys)) == 1
            with pytest.raises(kiln.BadRequestError):
                c.request("POST", "/final")
            assert sum(1 for p, _ in Flaky.log if p == "/final") == 1  # x-should-retry: false
    finally:
        server.shutdown()
    with kiln.Client(f"http://127.0.0.1:{free_port()}", "k", backoff=0.01, max_retries=2) as c:
        with pytest.raises(kiln.APIConnectionError, match="could not reach"):
            c.jobs.list()


def cli(pg_stack, *args, key="alice"):
    env = {**os.environ, "KILN_BASE_URL": pg_stack.base_url, "KILN_API_KEY": pg_stack.keys[key]}
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_cli_upload_create_watch_logs_download(pg_stack, sample, tmp_path):
    up = cli(pg_stack, "--json", "upload", str(sample / "train.jsonl"))
    assert up.returncode == 0, up.stderr
    train = json.loads(up.stdout)["id"]
    images = json.loads(cli(pg_stack, "--json", "upload", str(sample / "images.zip")).stdout)["id"]
    run = cli(
        pg_stack,
        "--json",
        "create",
        "--model",
        "kiln-tiny",
        "--training-file",
        train,
        "--images-file",
        images,
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--lora-rank",
        "2",
        "--watch",
    )
    assert run.returncode == 0, run.stderr
    docs = [json.loads(line) for line in run.stdout.splitlines()]  # JSON Lines
    job_id, final = docs[0]["id"], docs[-1]
    assert docs[0]["status"] == "queued" and final["id"] == job_id and final["status"] == "succeeded"
    metrics = [d for d in docs[1:-1] if d["type"] == "metrics"]
    assert [m["data"]["step"] for m in metrics] == list(range(1, 16))
    logs = cli(pg_stack, "logs", job_id)
    assert logs.returncode == 0 and logs.stdout.strip().endswith("The job has successfully completed")
    out = tmp_path / "adapter.zip"
    dl = cli(pg_stack, "download", job_id, "-o", str(out))
    assert dl.returncode == 0 and f"saved {out}" in dl.stdout and zipfile.is_zipfile(out)
    jobs = cli(pg_stack, "jobs")
    assert job_id in jobs.stdout
    keys = cli(pg_stack, "--json", "keys", "list")
    assert keys.returncode == 0 and json.loads(keys.stdout)[0]["id"].startswith("key_")


def test_cli_errors_and_local_validation(pg_stack, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    up = cli(pg_stack, "upload", str(bad))
    assert up.returncode == 2 and "line 1: messages[0].role: unknown role 'wizard'" in up.stderr
    local = cli(pg_stack, "validate", str(bad))
    assert local.returncode == 1 and "line 1: messages[0].role" in local.stdout
    assert cli(pg_stack, "get", "ftjob-nope").returncode == 2
    missing = cli(pg_stack, "download", "ftjob-nope")
    assert missing.returncode == 2 and "No fine-tuning job found" in missing.stderr
