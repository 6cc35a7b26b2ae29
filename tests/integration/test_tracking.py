"""Experiment tracking through OpenAI's ``integrations`` (#35): a real ``mlflow server`` on
127.0.0.1 gets a run per job (parameters, every step's metrics, the adapter as an artifact), and
wandb's own library writes an offline run whose file the test reads back record by record. A
tracking server that is down is a warning event, never a failed job."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import all_events, finished, wait_for
from tests.stack import free_port


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{home / 'mlflow.sqlite'}",
            "--artifacts-destination",
            str(home / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=open(home / "log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None and pytest.fail((home / "log").read_text()[-2000:])

    wait_for(up, timeout=120, interval=0.5, what="the mlflow server")
    yield url, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def stack(make_pg_stack, mlflow_server):
    return make_pg_stack(mlflow_tracking_uri=mlflow_server[0], wandb_mode="offline")


def wandb_records(run_file: Path) -> list:
    """The records of a wandb run file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (7-byte header: crc, length, type full/first/middle/last) carry wandb's Record protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, part = run_file.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0:  # the block's zero padding
            pos += left - 7
            continue
        chunk, pos = data[pos : pos + length], pos + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf code
            rec.ParseFromString(part)
            out.append(rec)
    return out


def test_a_job_is_tracked_in_mlflow_and_wandb(stack, mlflow_server):
    from mlflow import MlflowClient

    row = json.dumps({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})
    with stack.client() as c:
        f = c.post("/v1/files", files={"file": ("t.jsonl", (row + "\n") * 12)}, data={"purpose": "fine-tune"}).json()
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-tiny",
                "training_file": f["id"],
                "hyperparameters": {"max_steps": 3, "batch_size": 4},
                "integrations": [
                    {"type": "wandb", "wandb": {"project": "kiln-test", "tags": ["ci"]}},
                    {"type": "mlflow", "mlflow": {"experiment": "kiln-test", "tags": {"team": "ml"}}},
                ],
            },
        ).json()
        assert [i["type"] for i in job["integrations"]] == ["wandb", "mlflow"]
        done = finished(c, job["id"])
        assert done["status"] == "succeeded", done["error"]
        assert not [e for e in all_events(c, job["id"]) if e["level"] == "warn"]
        losses = {
            e["data"]["step"]: e["data"]["train_loss"] for e in all_events(c, job["id"]) if e["type"] == "metrics"
        }

    client = MlflowClient(tracking_uri=mlflow_server[0])
    exp = client.get_experiment_by_name("kiln-test")
    assert exp is not None
    [run] = client.search_runs([exp.experiment_id], filter_string=f"tags.`kiln.job_id` = '{job['id']}'")
    assert run.info.status == "FINISHED" and run.data.tags["team"] == "ml"
    assert run.data.params["model"] == "kiln-tiny" and run.data.params["max_steps"] == "3"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "adapter")] == ["adapter/adapter.zip"]

    [run_file] = (stack.home / "wandb").rglob(f"run-{job['id']}.wandb")
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_rec.project == "kiln-test" and list(run_rec.tags) == ["ci"]
    config = {
        i.key or "/".join(i.nested_key): json.loads(i.value_json)
        for r in records
        if r.HasField("config")
        for i in r.config.update
    }
    assert config["model"] == "kiln-tiny" and config["max_steps"] == 3
    logged = {}
    for r in records:
        if r.HasField("history"):
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            if "train_loss" in items:
                logged[items["_step"]] = items["train_loss"]
    assert logged == pytest.approx(losses)
    assert "artifact" in kinds and next(r.exit for r in records if r.HasField("exit")).exit_code == 0


def test_a_tracking_server_down_is_an_event_not_a_failure(stack, mlflow_server):
    _, proc = mlflow_server
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    row = json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
    with stack.client() as c:
        f = c.post("/v1/files", files={"file": ("u.jsonl", (row + "\n") * 8)}, data={"purpose": "fine-tune"}).json()
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-tiny",
                "training_file": f["id"],
                "hyperparameters": {"max_steps": 2, "batch_size": 4},
                "integrations": [{"type": "mlflow", "mlflow": {}}],
            },
        ).json()
        done = finished(c, job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        warnings = [e["message"] for e in all_events(c, job["id"]) if e["level"] == "warn"]
        assert any(m.startswith("Tracking to MLflow failed (start:") for m in warnings), warnings
