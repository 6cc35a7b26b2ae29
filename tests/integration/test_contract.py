"""The job contract and the service defects outside testing found (#30), each against the real
stack: PostgreSQL, Redis, the API under uvicorn and a Celery worker process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psycopg
import pytest

from tests.conftest import all_events, finished, wait_for


@pytest.fixture(scope="module")
def stack(make_pg_stack):
    return make_pg_stack()


@pytest.fixture(scope="module")
def dataset(stack, sample):
    with stack.client() as c:
        up = lambda name: c.post(
            "/v1/files", files={"file": (name, (sample / name).read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        return {"training_file": up("train.jsonl"), "images_file": up("images.zip")}


def sql(stack, query: str, *args) -> None:
    with psycopg.connect(stack.env["KILN_DATABASE_URL"].replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(query, args)


def metric_steps(c, job_id: str) -> dict[int, float]:
    events = [e for e in all_events(c, job_id) if e["type"] == "metrics"]
    steps = [e["data"]["step"] for e in events]
    assert len(steps) == len(set(steps)), "one metrics event per step"
    return {e["data"]["step"]: e["data"]["train_loss"] for e in events}


def test_an_idempotency_key_is_bound_to_its_request(stack, dataset):
    with stack.client() as c:
        body = {"model": "kiln-tiny", **dataset, "hyperparameters": {"max_steps": 1}}
        first = c.post("/v1/fine_tuning/jobs", json=body, headers={"Idempotency-Key": "k-job"})
        assert first.status_code == 200
        again = c.post("/v1/fine_tuning/jobs", json=body, headers={"Idempotency-Key": "k-job"})
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        other = c.post("/v1/fine_tuning/jobs", json={**body, "suffix": "other"}, headers={"Idempotency-Key": "k-job"})
        assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
        assert "was already used for a different request" in other.json()["error"]["message"]
        # uploads: the same file again answers as the first time; another file under the key is a 409
        up = lambda content, key: c.post(
            "/v1/files",
            files={"file": ("a.jsonl", content)},
            data={"purpose": "fine-tune"},
            headers={"Idempotency-Key": key},
        )
        row = json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
        a = up(row.encode() + b"\n", "k-file")
        assert a.status_code == 200 and up(row.encode() + b"\n", "k-file").json()["id"] == a.json()["id"]
        b = up((row + "\n" + row + "\n").encode(), "k-file")
        assert b.status_code == 409 and b.json()["error"]["code"] == "idempotency_key_reused"
        assert len([f for f in c.get("/v1/files").json()["data"] if f["filename"] == "a.jsonl"]) == 1
        # keys expire after 24 hours: then the key is free for a new request
        sql(stack, "UPDATE idempotency_keys SET expires_at = 1 WHERE key = %s", "k-job")
        later = c.post("/v1/fine_tuning/jobs", json={**body, "suffix": "later"}, headers={"Idempotency-Key": "k-job"})
        assert later.status_code == 200 and later.json()["id"] != first.json()["id"]


def test_files_list_in_either_order(stack, dataset):
    with stack.client() as c:
        desc = [f["id"] for f in c.get("/v1/files").json()["data"]]
        asc = [f["id"] for f in c.get("/v1/files", params={"order": "asc"}).json()["data"]]
        assert len(asc) >= 2 and asc == desc[::-1]
        r = c.get("/v1/files", params={"order": "sideways"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "order"


def test_a_job_keeps_its_request_and_its_resolved_settings_apart(stack, dataset):
    with stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", **dataset, "hyperparameters": {"max_steps": 1}, "lora": {"rank": 4}},
        ).json()
        assert job["requested"] == {
            "hyperparameters": {"max_steps": 1},
            "lora": {"rank": 4},
            "method": "supervised",
            "integrations": [],
        }
        extras = job["method"]["supervised"]["hyperparameters"]
        assert extras["max_steps"] == 1 and extras["warmup_ratio"] == 0.05 and extras["max_seq_len"] == 2048
        assert job["lora"]["rank"] == 4 and "q_proj" in job["lora"]["target_modules"]
        finished(c, job["id"])


def test_pause_frees_the_worker_and_resume_continues_exactly(stack, dataset):
    body = {
        "model": "kiln-tiny",
        **dataset,
        "seed": 11,
        # the whole epoch (60 steps), so that the pause is read before the end: the worker reads
        # the job's row at most once a second, and the 26 steps after the 4th of 30 once ran inside it
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "max_steps": 60, "checkpoint_interval": 1000},
    }
    with stack.client() as c:
        reference = finished(c, c.post("/v1/fine_tuning/jobs", json=body).json()["id"])
        assert reference["status"] == "succeeded"
        job = c.post("/v1/fine_tuning/jobs", json=body).json()
        wait_for(lambda: len(metric_steps(c, job["id"])) >= 4, interval=0.05, what="a few steps")
        paused = c.post(f"/v1/fine_tuning/jobs/{job['id']}/pause")
        assert paused.status_code == 200 and paused.json()["status"] in ("pausing", "paused")
        # the worker lets the job go: another job runs to the end while this one is paused
        other = c.post(
            "/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **dataset, "hyperparameters": {"max_steps": 2}}
        ).json()
        assert finished(c, other["id"])["status"] == "succeeded"
        assert c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "paused"
        at = max(metric_steps(c, job["id"]))
        assert 4 <= at < 60
        ckpts = c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        assert [k["step_number"] for k in ckpts] == [at]  # saved where it paused
        assert c.post(f"/v1/fine_tuning/jobs/{job['id']}/pause").json()["status"] == "paused"  # idempotent
        again = c.post(f"/v1/fine_tuning/jobs/{job['id']}/resume")
        assert again.status_code == 200 and again.json()["status"] in ("queued", "running")
        done = finished(c, job["id"])
        assert done["status"] == "succeeded" and done["attempt"] == 2
        messages = [e["message"] for e in all_events(c, job["id"])]
        assert f"Resumed from the checkpoint at step {at}" in messages
        assert metric_steps(c, job["id"]) == metric_steps(c, reference["id"])  # every step's loss, exactly
        r = c.post(f"/v1/fine_tuning/jobs/{job['id']}/resume")
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_paused"


def test_a_queued_job_pauses_at_once_and_keeps_its_place(stack, dataset):
    for w in list(stack.workers):
        if w.poll() is None:
            stack.kill_worker(w)
    with stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **dataset, "hyperparameters": {"max_steps": 2}}
        ).json()
        assert c.post(f"/v1/fine_tuning/jobs/{job['id']}/pause").json()["status"] == "paused"
        stack.start_worker()  # takes the job's message, and leaves the paused job alone
        time.sleep(3)
        assert c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "paused"
        assert c.post(f"/v1/fine_tuning/jobs/{job['id']}/resume").json()["status"] in ("queued", "running")
        assert finished(c, job["id"])["status"] == "succeeded"
        stack.kill_worker(stack.workers[-1])
        paused = c.post(
            "/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **dataset, "hyperparameters": {"max_steps": 2}}
        ).json()
        c.post(f"/v1/fine_tuning/jobs/{paused['id']}/pause")
        cancelled = c.post(f"/v1/fine_tuning/jobs/{paused['id']}/cancel").json()
        assert cancelled["status"] == "cancelled"
        r = c.post(f"/v1/fine_tuning/jobs/{paused['id']}/pause")
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_pausable"
    stack.start_worker()


def test_the_estimate_comes_from_finished_jobs(stack, dataset):
    with stack.client() as c:
        rep = c.get(f"/v1/files/{dataset['training_file']}/report", params={"images_file": dataset["images_file"]})
        est = rep.json()["estimate"]
        assert est["confidence"] in ("low", "medium", "high") and est["worker_kind"] == "cpu"
        assert "finished job" in est["basis"] and est["low"] <= est["seconds"] <= est["high"]
        fresh = c.get(
            f"/v1/files/{dataset['training_file']}/report",
            params={"images_file": dataset["images_file"], "model": "kiln-hybrid-tiny"},
        ).json()["estimate"]
        assert fresh["confidence"] == "none" and "no finished job on kiln-hybrid-tiny" in fresh["basis"]


def test_shutdown_ends_open_event_streams(make_pg_stack):
    stack = make_pg_stack(workers=0)  # no worker: the job stays queued and its stream stays open
    with stack.client() as c:
        row = json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
        f = c.post("/v1/files", files={"file": ("t.jsonl", (row + "\n") * 4)}, data={"purpose": "fine-tune"})
        job = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f.json()["id"]}).json()
    frames: list[str] = []

    def listen() -> None:
        with stack.client(timeout=120) as s, s.stream("GET", f"/v1/fine_tuning/jobs/{job['id']}/events/stream") as r:
            for line in r.iter_lines():
                frames.append(line)

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    wait_for(lambda: any(line.startswith("event: status") for line in frames), what="the stream to open")
    assert stack.api is not None
    t0 = time.monotonic()
    os.killpg(stack.api.pid, signal.SIGTERM)
    stack.api.wait(timeout=30)
    took = time.monotonic() - t0
    reader.join(timeout=5)
    assert took < 5, f"the API took {took:.1f} s to stop with a stream open"
    assert "event: shutdown" in frames and not reader.is_alive()


def test_the_openapi_document_is_the_api(stack):
    doc = httpx.get(f"{stack.base_url}/openapi.json").json()
    ops = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    assert len(ops) >= 17
    for path, method, op in ops:
        codes = set(op["responses"])
        assert "422" not in codes, (method, path)
        assert {"401", "429"} <= codes, (method, path)
        if "{" in path:
            assert "404" in codes, (method, path)
        for code, resp in op["responses"].items():
            if code.startswith(("4", "5")):
                assert resp["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
            elif code == "200" and method != "delete" and not path.endswith(("/content", "/adapter", "/stream")):
                assert "$ref" in json.dumps(resp["content"]["application/json"]["schema"]), (method, path)
    assert doc["paths"]["/v1/fine_tuning/jobs/{job_id}/pause"]["post"]
    limit = next(p for p in doc["paths"]["/v1/fine_tuning/jobs"]["get"]["parameters"] if p["name"] == "limit")
    assert limit["schema"]["minimum"] == 1 and limit["schema"]["maximum"] == 100
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    with stack.client() as c:
        r = c.options("/v1/fine_tuning/jobs")
        assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "OPTIONS", "POST"}
        r = c.delete("/v1/fine_tuning/jobs")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "OPTIONS", "POST"}
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.put("/v1/files/file-x")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"DELETE", "GET", "HEAD", "OPTIONS"}


def test_the_sdk_takes_the_typed_contract(stack, dataset):
    from kiln import Client, Hyperparameters, JobRequest, LoraSpec

    with Client(stack.base_url, api_key=stack.keys["alice"]) as client:
        with pytest.raises(ValueError, match="n_epoch: unknown field; did you mean 'n_epochs'"):
            client.jobs.create("kiln-tiny", dataset["training_file"], hyperparameters={"n_epoch": 2})
        job = client.jobs.create(
            "kiln-tiny",
            dataset["training_file"],
            images_file=dataset["images_file"],
            hyperparameters=Hyperparameters(max_steps=2, batch_size=4),
            lora=LoraSpec(rank=2, target_modules=["q_proj", "v_proj"]),
        )
        assert job.requested == {
            "hyperparameters": {"max_steps": 2, "batch_size": 4},
            "lora": {"rank": 2, "target_modules": ["q_proj", "v_proj"]},
            "method": "supervised",
            "integrations": [],
        }
        assert client.jobs.wait(job.id).status == "succeeded"
        request = JobRequest(
            model="kiln-tiny", training_file=dataset["training_file"], images_file=dataset["images_file"]
        )
        again = client.jobs.create(request)
        assert client.jobs.pause(again.id).status in ("paused", "pausing")
        assert client.jobs.resume(again.id).status in ("queued", "running")
        client.jobs.cancel(again.id)
