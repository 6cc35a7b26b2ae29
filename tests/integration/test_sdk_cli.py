"""The kiln SDK and CLI against the real server; retries against a real flaky HTTP server;
kiln-admin against a database without tables."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kiln
from kiln import cli as kiln_cli
from tests.conftest import wait_for
from tests.stack import create_pg_database, drop_pg_database, free_port

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


def run_module(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def cli(pg_stack, *args, key="alice"):
    return run_module("kiln.cli", *args, KILN_BASE_URL=pg_stack.base_url, KILN_API_KEY=pg_stack.keys[key])


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_cli_upload_create_watch_logs_download(pg_stack, sample, tmp_path):
    up = cli(pg_stack, "upload", str(sample / "train.jsonl"))  # text: readable, no Python dict
    assert up.returncode == 0, up.stderr
    assert re.fullmatch(
        r"file-\S+  train\.jsonl  \d+ bytes  format chat  examples 240  messages 480  images 147(  \w+ [\d.]+)*\n",
        up.stdout,
    ), up.stdout
    up = cli(pg_stack, "upload", str(sample / "train.jsonl"), "--json")  # --json after the subcommand
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
    assert job_id in [j["id"] for j in json_lines(cli(pg_stack, "jobs", "--json").stdout)]
    ckpts = cli(pg_stack, "checkpoints", job_id)
    assert ckpts.returncode == 0 and "{" not in ckpts.stdout, ckpts.stdout
    assert re.fullmatch(r"ftckpt\S+  step 15  [-\d]+ [:\d]+  (\S+ \S+  )*train_loss [\d.]+.*\n", ckpts.stdout)
    assert [c["step_number"] for c in json_lines(cli(pg_stack, "checkpoints", job_id, "--json").stdout)] == [15]
    keys = cli(pg_stack, "keys", "list", "--json")  # JSON Lines: one key a line
    assert keys.returncode == 0 and all(k["id"].startswith("key_") for k in json_lines(keys.stdout))


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


def test_cli_validate_reports_missing_images(sample, tmp_path):
    """Without --images, a JSONL naming images is not ok: each missing one by line and field."""
    alone = run_module("kiln.cli", "validate", str(sample / "train.jsonl"))
    assert alone.returncode == 1
    assert alone.stdout.startswith(
        "line 1: images[0]: image 'images/train_0000.png' not found: pass the zip of the images with --images ZIP"
    )
    assert alone.stdout.rstrip().endswith("(more problems not shown: the first 100 are)")
    issues = json.loads(run_module("kiln.cli", "validate", str(sample / "train.jsonl"), "--json").stdout)["issues"]
    assert len(issues) == 100 and {i["field"] for i in issues} == {"images[0]"}
    given = run_module("kiln.cli", "validate", str(sample / "train.jsonl"), "--images", str(sample / "images.zip"))
    assert given.returncode == 0 and given.stdout.startswith("ok: format chat  examples 240  messages 480  images 147")
    # one zip holding the JSONL and its images needs no --images; an image it lacks is named
    lines = (sample / "train.jsonl").read_text().splitlines()[:4]  # lines 1 and 4 name an image each
    with zipfile.ZipFile(sample / "images.zip") as src, zipfile.ZipFile(tmp_path / "set.zip", "w") as dst:
        dst.writestr("set/train.jsonl", "\n".join(lines) + "\n")
        dst.writestr("set/images/train_0000.png", src.read("images/train_0000.png"))
    zipped = run_module("kiln.cli", "validate", str(tmp_path / "set.zip"))
    assert zipped.returncode == 1 and zipped.stdout.startswith("line 4: images[0]: image 'images/train_0003.png'")
    assert "--images ZIP" in zipped.stdout and zipped.stdout.count("\n") == 1
    with zipfile.ZipFile(sample / "images.zip") as src, zipfile.ZipFile(tmp_path / "set.zip", "a") as dst:
        dst.writestr("set/images/train_0003.png", src.read("images/train_0003.png"))
    assert run_module("kiln.cli", "validate", str(tmp_path / "set.zip")).returncode == 0


def _actions(parser: argparse.ArgumentParser, where: str = "kiln"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{where} {choice.dest}", choice
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{where} {name}")
        else:
            yield f"{where} {'/'.join(action.option_strings) or action.dest}", action


def test_cli_every_option_and_command_has_help():
    missing = [name for name, action in _actions(kiln_cli._parser()) if not action.help]
    assert missing == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "--base-url", "http://x", "--api-key", "k", "keys", "list"],
        ["keys", "list", "--json", "--base-url", "http://x", "--api-key", "k"],
        ["--base-url", "http://x", "keys", "--api-key", "k", "list", "--json"],
    ],
)
def test_cli_common_options_before_or_after_the_subcommand(argv):
    args = kiln_cli._parser().parse_args(argv)
    assert (args.json, args.base_url, args.api_key) == (True, "http://x", "k")
    plain = kiln_cli._parser().parse_args(["jobs"])
    assert (plain.json, plain.base_url, plain.api_key) == (False, None, None)


def test_cli_create_takes_any_hyperparameter_lora_targets_and_metadata():
    args = kiln_cli._parser().parse_args(
        [
            *("create", "--model", "kiln-tiny", "--training-file", "file-1", "--epochs", "2"),
            *("--hyperparameter", "max_steps=5", "--hyperparameter", 'memory={"recompute": "full"}'),
            *("--hyperparameter", "learning_rate_multiplier=auto", "--hyperparameter", "packing=false"),
            *("--lora-rank", "4", "--lora-dropout", "0.1", "--lora-target-modules", "q_proj, v_proj"),
            *("--lora-target-parameters", "mlp.experts.gate_up_proj", "--metadata", "team=ci", "--metadata", "n=7"),
        ]
    )
    assert kiln_cli._job_body(args) == {
        "validation_file": None,
        "images_file": None,
        "hyperparameters": {
            "max_steps": 5,
            "memory": {"recompute": "full"},
            "learning_rate_multiplier": "auto",
            "packing": False,
            "n_epochs": 2,
        },
        "lora": {
            "rank": 4,
            "dropout": 0.1,
            "target_modules": ["q_proj", "v_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj"],
        },
        "suffix": None,
        "seed": None,
        "metadata": {"team": "ci", "n": "7"},  # metadata stays text
    }
    base = ["create", "--model", "m", "--training-file", "f"]
    for extra, message in (
        (["--epochs", "2", "--hyperparameter", "n_epochs=3"], "--epochs and --hyperparameter n_epochs=… both"),
        (["--hyperparameter", "max_steps"], "expected KEY=VALUE"),
        (["--metadata", "a=1", "--metadata", "a=2"], "--metadata a is given twice"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            kiln_cli._job_body(kiln_cli._parser().parse_args(base + extra))


@pytest.fixture(scope="module")
def uploaded(client, sample) -> tuple[str, str]:
    return client.files.upload(sample / "train.jsonl").id, client.files.upload(sample / "images.zip").id


def test_cli_create_options_reach_the_job(pg_stack, uploaded):
    train, images = uploaded
    made = cli(
        pg_stack,
        *("create", "--model", "kiln-tiny", "--training-file", train, "--images-file", images, "--json"),
        *("--hyperparameter", "max_steps=2", "--hyperparameter", 'memory={"recompute": "full"}'),
        *("--lora-rank", "4", "--lora-dropout", "0.1", "--lora-target-modules", "q_proj,v_proj"),
        *("--metadata", "team=ci", "--watch"),
    )
    assert made.returncode == 0, made.stderr
    docs = json_lines(made.stdout)
    assert docs[-1]["status"] == "succeeded" and [d["data"]["step"] for d in docs if d.get("type") == "metrics"] == [
        1,
        2,
    ]
    job = json.loads(cli(pg_stack, "get", docs[0]["id"], "--json").stdout)
    hp = job["method"]["supervised"]["hyperparameters"]
    assert hp["max_steps"] == 2 and hp["memory"]["recompute"] == "full"
    assert job["lora"]["target_modules"] == ["q_proj", "v_proj"] and job["lora"]["dropout"] == 0.1
    assert job["lora"]["rank"] == 4 and job["metadata"] == {"team": "ci"}


class JobRoutes(BaseHTTPRequestHandler):
    """Answers any POST with a job in the state the path names; remembers the paths."""

    posts: list = []

    def do_POST(self):
        self.posts.append(self.path)
        state = {"pause": "paused", "resume": "running"}.get(self.path.rsplit("/", 1)[-1], "queued")
        body = {"id": "ftjob-1", "status": state, "model": "kiln-tiny", "created_at": 1, "training_file": "file-1"}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_cli_pause_and_resume_post_to_their_routes():
    server = ThreadingHTTPServer(("127.0.0.1", 0), JobRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        paused = run_module("kiln.cli", "pause", "ftjob-1", "--base-url", url, "--api-key", "k")
        assert paused.returncode == 0 and paused.stdout == "ftjob-1  paused  (pause requested)\n"
        resumed = run_module("kiln.cli", "resume", "ftjob-1", "--json", "--base-url", url, "--api-key", "k")
        assert resumed.returncode == 0 and json.loads(resumed.stdout)["status"] == "running"
        assert JobRoutes.posts == ["/v1/fine_tuning/jobs/ftjob-1/pause", "/v1/fine_tuning/jobs/ftjob-1/resume"]
    finally:
        server.shutdown()


HAS_PAUSE = "/pause" in (ROOT / "api" / "routes" / "jobs.py").read_text()


@pytest.mark.skipif(not HAS_PAUSE, reason="the API has no pause route yet (api/routes/jobs.py)")
def test_cli_pause_and_resume_a_running_job(pg_stack, client, uploaded):
    """A running job pauses at its next step (pausing, then paused) and resume puts it back in line."""
    train, images = uploaded
    job = client.jobs.create("kiln-tiny", train, images_file=images, hyperparameters={"max_steps": 200})
    wait_for(lambda: client.jobs.get(job.id).status == "running", what=f"{job.id} to run")
    paused = cli(pg_stack, "pause", job.id)
    assert paused.returncode == 0, paused.stderr
    assert re.fullmatch(rf"{job.id}  (pausing|paused)  \(pause requested\)\n", paused.stdout), paused.stdout
    wait_for(lambda: client.jobs.get(job.id).status == "paused", what=f"{job.id} to pause")
    resumed = cli(pg_stack, "resume", job.id, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["status"] in ("queued", "running")
    assert cli(pg_stack, "cancel", job.id).returncode == 0
    wait_for(lambda: client.jobs.get(job.id).done, what=f"{job.id} to end")


def test_admin_before_migrate_says_so_in_one_line(tmp_path):
    """SQLite and PostgreSQL: every command but migrate, on a database without tables."""
    name, pg_url = create_pg_database()
    try:
        for url in (f"sqlite:///{tmp_path / 'kiln.sqlite'}", pg_url):
            env = {"KILN_HOME": str(tmp_path), "KILN_DATABASE_URL": url}
            for args in (["create-key", "--owner", "a"], ["list-keys"], ["revoke-key", "key_x"]):
                done = run_module("api.admin", *args, **env)
                assert (done.returncode, done.stdout, done.stderr) == (
                    2,
                    "",
                    "error: the database has no tables yet: run kiln-admin migrate first\n",
                ), args
            assert run_module("api.admin", "migrate", **env).returncode == 0
            assert run_module("api.admin", "create-key", "--owner", "a", **env).stdout.startswith("sk-kiln-")
    finally:
        drop_pg_database(name)
    gone = run_module("api.admin", "list-keys", KILN_DATABASE_URL="postgresql+psycopg://u:pw@127.0.0.1:1/x")
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1, gone.stderr
    assert gone.stderr.startswith("error: the database postgresql+psycopg://u:***@127.0.0.1:1/x: ")
