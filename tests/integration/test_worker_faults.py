"""Messages arrive twice, users cancel, a dataset changes on disk: the job still trains exactly
once. (A worker killed mid-job, and the job resumed from its checkpoint by another worker:
tests/integration/test_s3_flow.py, on the production store.)"""

from __future__ import annotations

import json

import pytest

from api.queue import RUN_TASK, make_celery
from api.settings import Settings
from tests.conftest import all_events, finished, wait_for


@pytest.fixture(scope="module")
def dataset(pg_stack, sample):
    with pg_stack.client() as c:
        up = lambda name: c.post(
            "/v1/files", files={"file": (name, (sample / name).read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        return {"training_file": up("train.jsonl"), "images_file": up("images.zip")}


def status(c, job_id):
    return c.get(f"/v1/fine_tuning/jobs/{job_id}").json()


def test_duplicate_delivery_trains_once(pg_stack, dataset):
    celery = make_celery(Settings(broker_url=pg_stack.env["KILN_BROKER_URL"], queue=pg_stack.env["KILN_QUEUE"]))
    pg_stack.start_worker()  # two workers now compete for the same messages
    with pg_stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", **dataset, "hyperparameters": {"n_epochs": 1, "batch_size": 4}},
        ).json()
        for _ in range(3):
            celery.send_task(RUN_TASK, args=[job["id"]], queue=pg_stack.env["KILN_QUEUE"])
        done = finished(c, job["id"])
        assert done["status"] == "succeeded" and done["attempt"] == 1
        events = all_events(c, job["id"])
        assert [e["message"] for e in events].count("Fine-tuning job started") == 1
        steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
        assert sorted(steps) == list(range(1, 61))


def test_cancel_stops_a_running_job_between_steps(pg_stack, dataset):
    with pg_stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", **dataset, "hyperparameters": {"n_epochs": 20, "batch_size": 4}},
        ).json()
        wait_for(lambda: any(e["type"] == "metrics" for e in all_events(c, job["id"])), what="training to start")
        r = c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
        assert r.status_code == 200 and r.json()["cancel_requested"]
        done = wait_for(lambda: (j := status(c, job["id"]))["status"] != "running" and j, timeout=60, what="cancel")
        assert done["status"] == "cancelled" and done["fine_tuned_model"] is None
        steps = [e["data"]["step"] for e in all_events(c, job["id"]) if e["type"] == "metrics"]
        assert max(steps) < 1200
        assert c.get(f"/v1/fine_tuning/jobs/{job['id']}/adapter").status_code == 409


def test_cancel_queued_job_never_trains(pg_stack, dataset):
    for w in list(pg_stack.workers):
        if w.poll() is None:
            pg_stack.kill_worker(w)
    with pg_stack.client() as c:
        job = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **dataset}).json()
        assert job["status"] == "queued"
        cancelled = c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").json()
        assert cancelled["status"] == "cancelled"
        pg_stack.start_worker()
        other = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", **dataset, "hyperparameters": {"n_epochs": 1, "batch_size": 16}},
        ).json()
        wait_for(lambda: status(c, other["id"])["status"] == "succeeded", timeout=180, what="the next job")
        assert status(c, job["id"])["status"] == "cancelled"
        assert not [e for e in all_events(c, job["id"]) if e["type"] == "metrics"]


def test_dataset_corrupted_on_disk_fails_the_job_naming_line_and_field(pg_stack):
    """The engine checks what it reads again: a stored dataset damaged after the job was
    accepted fails the job with the line and field, not a crash."""
    import hashlib

    rows = [
        {"messages": [{"role": "user", "content": f"q{i} corrupt-test"}, {"role": "assistant", "content": "a"}]}
        for i in range(6)
    ]
    content = "\n".join(json.dumps(r) for r in rows).encode() + b"\n"
    for w in list(pg_stack.workers):
        if w.poll() is None:
            pg_stack.kill_worker(w)
    with pg_stack.client() as c:
        f = c.post("/v1/files", files={"file": ("c.jsonl", content)}, data={"purpose": "fine-tune"}).json()
        job = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f["id"]}).json()
        assert job["status"] == "queued"
        sha = hashlib.sha256(content).hexdigest()
        obj = pg_stack.store / "objects" / sha[:2] / sha
        lines = obj.read_bytes().splitlines(keepends=True)
        obj.write_bytes(lines[0] + b'{"messages": [{"role": "robot", "content": "x"}]}\n' + b"".join(lines[2:]))
        pg_stack.start_worker()
        done = finished(c, job["id"])
        assert done["status"] == "failed"
        assert done["error"]["code"] == "invalid_training_file" and done["error"]["param"] == "training_file"
        assert "line 2: messages[0].role: unknown role 'robot'" in done["error"]["message"]
        levels = [(e["level"], e["message"][:14]) for e in all_events(c, job["id"])]
        assert ("error", "Dataset error:") in levels
