"""The whole path through the official openai SDK against the real server, PostgreSQL, Redis
and a Celery worker process."""

from __future__ import annotations

import io
import json
import zipfile

import openai
import pytest
from safetensors.numpy import load as load_safetensors

from tests.conftest import wait_for


@pytest.fixture(scope="module")
def oai(pg_stack):
    return openai.OpenAI(base_url=f"{pg_stack.base_url}/v1", api_key=pg_stack.keys["alice"], max_retries=0)


@pytest.fixture(scope="module")
def finished_job(oai, sample):
    train = oai.files.create(file=open(sample / "train.jsonl", "rb"), purpose="fine-tune")
    valid = oai.files.create(file=open(sample / "validation.jsonl", "rb"), purpose="fine-tune")
    images = oai.files.create(file=open(sample / "images.zip", "rb"), purpose="fine-tune")
    assert train.status == "processed" and images.status == "processed"
    job = oai.fine_tuning.jobs.create(
        model="kiln-tiny",
        training_file=train.id,
        validation_file=valid.id,
        suffix="shapes",
        seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 8}}},
        extra_body={"images_file": images.id, "lora": {"rank": 4, "alpha": 8}},
    )
    assert job.status in ("queued", "running") and job.id.startswith("ftjob-")
    done = wait_for(
        lambda: (j := oai.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed", "cancelled") and j,
        timeout=240,
        what="job to finish",
    )
    return done, train


def test_job_succeeds_and_loss_falls(oai, finished_job):
    job, _ = finished_job
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model.startswith("ft:kiln-tiny:alice:shapes:")
    assert job.trained_tokens > 0
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 8
    events = [e for e in oai.fine_tuning.jobs.list_events(job.id, limit=100)]
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert metrics[-1]["total_steps"] == len(metrics) == 60
    first, last = metrics[0]["train_loss"], sum(m["train_loss"] for m in metrics[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    valid = [m["valid_loss"] for m in metrics if "valid_loss" in m]
    assert len(valid) == 2 and valid[-1] < first
    messages = [e.message for e in events]
    assert "Fine-tuning job started" in messages and "The job has successfully completed" in messages


def test_events_paginate_newest_first(oai, finished_job):
    job, _ = finished_job
    page1 = oai.fine_tuning.jobs.list_events(job.id, limit=5)
    assert len(page1.data) == 5 and page1.has_more
    page2 = oai.fine_tuning.jobs.list_events(job.id, limit=5, after=page1.data[-1].id)
    ids1, ids2 = [e.id for e in page1.data], [e.id for e in page2.data]
    assert not set(ids1) & set(ids2)
    assert page1.data[0].message == "The job has successfully completed"


def test_checkpoints_listed_and_downloadable(oai, pg_stack, finished_job):
    job, _ = finished_job
    ckpts = oai.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in ckpts] == [60, 30]
    assert ckpts[0].fine_tuned_model_checkpoint.endswith(":ckpt-step-60")
    assert "valid_loss" in ckpts[0].metrics.model_dump()
    with pg_stack.client() as c:
        r = c.get(f"/v1/fine_tuning/jobs/{job.id}/checkpoints/{ckpts[1].id}/adapter")
    assert r.status_code == 200
    assert set(zipfile.ZipFile(io.BytesIO(r.content)).namelist()) == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }


def test_adapter_is_peft_layout(pg_stack, finished_job):
    job, _ = finished_job
    with pg_stack.client() as c:
        r = c.get(f"/v1/fine_tuning/jobs/{job.id}/adapter")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    zf = zipfile.ZipFile(io.BytesIO(r.content))
    config = json.loads(zf.read("adapter_config.json"))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == "kiln-tiny"
    tensors = load_safetensors(zf.read("adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (4, 256) and b.shape == (256, 4)
    assert abs(b).max() > 0  # B starts at zero: training moved it
    assert len(tensors) == 2 * 7 * 4  # 7 projections in each of 4 layers


def test_models_list_has_base_and_fine_tuned(oai, finished_job):
    job, _ = finished_job
    ids = [m.id for m in oai.models.list().data]
    assert "kiln-tiny" in ids and job.fine_tuned_model in ids
    assert oai.models.retrieve(job.fine_tuned_model).owned_by == "alice"


def test_jobs_list_paginates(oai, finished_job):
    job, train = finished_job
    page = oai.fine_tuning.jobs.list(limit=1)
    assert page.data[0].object == "fine_tuning.job"
    listed = [j.id for j in oai.fine_tuning.jobs.list(limit=1)]
    assert job.id in listed and len(listed) == len(set(listed))


def test_other_owner_sees_nothing(pg_stack, finished_job):
    job, train = finished_job
    with pg_stack.client("bob") as c:
        for path in (
            f"/v1/fine_tuning/jobs/{job.id}",
            f"/v1/fine_tuning/jobs/{job.id}/events",
            f"/v1/fine_tuning/jobs/{job.id}/checkpoints",
            f"/v1/fine_tuning/jobs/{job.id}/adapter",
            f"/v1/fine_tuning/jobs/{job.id}/events/stream",
            f"/v1/files/{train.id}",
            f"/v1/files/{train.id}/content",
        ):
            r = c.get(path)
            assert r.status_code == 404, (path, r.status_code)
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.post(f"/v1/fine_tuning/jobs/{job.id}/cancel").status_code == 404
        assert c.delete(f"/v1/files/{train.id}").status_code == 404
        assert job.id not in [j["id"] for j in c.get("/v1/fine_tuning/jobs").json()["data"]]
        assert job.fine_tuned_model not in [m["id"] for m in c.get("/v1/models").json()["data"]]


def test_sse_stream_replays_and_ends(pg_stack, finished_job):
    job, _ = finished_job
    frames = []
    with pg_stack.client() as c, c.stream("GET", f"/v1/fine_tuning/jobs/{job.id}/events/stream") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        event = {}
        for line in r.iter_lines():
            if line.startswith("event: "):
                event["event"] = line[7:]
            elif line.startswith("data: "):
                event["data"] = json.loads(line[6:])
            elif line.startswith("id: "):
                event["id"] = int(line[4:])
            elif not line and event:
                frames.append(event)
                event = {}
    kinds = [f["event"] for f in frames]
    assert kinds[-1] == "end" and frames[-1]["data"]["status"] == "succeeded"
    assert kinds.count("metrics") == 60
    resume_at = [f for f in frames if f["event"] == "metrics"][-1]["id"]
    with pg_stack.client() as c:
        tail = c.get(f"/v1/fine_tuning/jobs/{job.id}/events/stream", headers={"Last-Event-ID": str(resume_at)}).text
    assert "event: metrics" not in tail
    assert "The job has successfully completed" in tail


def test_file_list_content_and_delete(oai, pg_stack, sample):
    f = oai.files.create(file=open(sample / "test.jsonl", "rb"), purpose="fine-tune")
    assert f.bytes == (sample / "test.jsonl").stat().st_size
    assert oai.files.content(f.id).read() == (sample / "test.jsonl").read_bytes()
    assert f.id in [x.id for x in oai.files.list().data]
    assert oai.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(f.id)


def test_idempotency_key_replays_the_first_answer(pg_stack, sample):
    with pg_stack.client() as c:
        up = c.post(
            "/v1/files",
            files={"file": ("t.jsonl", (sample / "test.jsonl").read_bytes())},
            data={"purpose": "fine-tune"},
            headers={"Idempotency-Key": "up-1"},
        ).json()
        again = c.post(
            "/v1/files",
            files={"file": ("t.jsonl", (sample / "test.jsonl").read_bytes())},
            data={"purpose": "fine-tune"},
            headers={"Idempotency-Key": "up-1"},
        ).json()
        assert up["id"] == again["id"]
        text_only = [l for l in (sample / "test.jsonl").read_text().splitlines() if '"images"' not in l]
        tf = c.post(
            "/v1/files", files={"file": ("text.jsonl", "\n".join(text_only).encode())}, data={"purpose": "fine-tune"}
        ).json()
        body = {"model": "kiln-tiny", "training_file": tf["id"], "hyperparameters": {"n_epochs": 1}}
        j1 = c.post("/v1/fine_tuning/jobs", json=body, headers={"Idempotency-Key": "job-1"}).json()
        j2 = c.post("/v1/fine_tuning/jobs", json=body, headers={"Idempotency-Key": "job-1"}).json()
        assert j1["id"] == j2["id"]
        assert (
            len([j for j in c.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"] if j["id"] == j1["id"]])
            == 1
        )
        done = wait_for(
            lambda: (j := c.get(f"/v1/fine_tuning/jobs/{j1['id']}").json())["status"] in ("succeeded", "failed") and j,
            timeout=120,
            what="text-only job",
        )
        assert done["status"] == "succeeded", done["error"]


def test_sse_cursor_past_every_event_ends_cleanly(pg_stack, finished_job):
    """Found by schemathesis: a cursor beyond 32 bits broke the stream after it had started."""
    job, _ = finished_job
    with pg_stack.client() as c:
        for params, headers in (({"after": 2**40}, {}), ({}, {"Last-Event-ID": str(2**63)})):
            r = c.get(f"/v1/fine_tuning/jobs/{job.id}/events/stream", params=params, headers=headers)
            assert r.status_code == 200 and r.text.rstrip().endswith('"status": "succeeded"}')
            assert "event: end" in r.text and "event: metrics" not in r.text
