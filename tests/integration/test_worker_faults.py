"""Workers die, messages arrive twice, users cancel: the job still trains exactly once and
resumes from its last checkpoint."""

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


def test_killed_worker_job_resumes_from_checkpoint(pg_stack, dataset):
    with pg_stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-tiny",
                **dataset,
                "seed": 3,
                "hyperparameters": {"n_epochs": 3, "batch_size": 4, "checkpoint_interval": 10},
            },
        ).json()
        ckpts = wait_for(
            lambda: c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"],
            interval=0.1,
            what="first checkpoint",
        )
        killed_at = max(c["step_number"] for c in ckpts)
        wait_for(  # past the checkpoint: the resumed run replays steps whose events are stored
            lambda: (
                max([e["data"]["step"] for e in all_events(c, job["id"]) if e["type"] == "metrics"] or [0])
                >= killed_at + 2
            ),
            interval=0.05,
            what="steps after the checkpoint",
        )
        pg_stack.kill_worker(pg_stack.workers[0])  # SIGKILL: no clean-up, no ack
        assert status(c, job["id"])["status"] == "running"
        pg_stack.start_worker()
        done = finished(c, job["id"])
        assert done["status"] == "succeeded", done["error"]
        assert done["attempt"] == 2
        events = all_events(c, job["id"])
        messages = [e["message"] for e in events]
        assert any(m.startswith("Resumed from the checkpoint at step") for m in messages)
        resumed = [e["data"]["step"] for e in events if e["message"].startswith("Resumed from")][0]
        assert resumed >= killed_at  # at most one checkpoint interval is lost
        steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
        # the resumed run replays the steps after its checkpoint; each step has one metrics event
        assert sorted(steps) == list(range(1, 181))
        assert "The worker stopped responding; the job is queued again and resumes from its last checkpoint" in messages


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
