"""The whole job flow on an S3 store (SeaweedFS) with no folder shared between the API and the
workers: each has its own KILN_HOME and cache, as on separate machines. A worker killed mid-run
(kill -9) leaves its checkpoint in the bucket; another worker, on a fresh disk, resumes from it."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest

from tests.conftest import all_events, finished, wait_for

STEPS, INTERVAL = 6, 2  # the smallest job that checkpoints, is killed and resumes


@pytest.fixture(scope="module")
def s3_stack(make_pg_stack, s3_server, tmp_path_factory):
    bucket = s3_server.bucket()
    stack = make_pg_stack(
        env=s3_server.env, worker_home=tmp_path_factory.mktemp("worker0"), store_url=f"s3://{bucket}/kiln"
    )
    return stack, bucket


def test_a_job_on_s3_resumes_on_another_worker_with_nothing_shared(s3_stack, s3_server, sample, tmp_path):
    stack, bucket = s3_stack
    with stack.client() as c:
        up = lambda name: c.post(
            "/v1/files", files={"file": (name, (sample / name).read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        files = {"training_file": up("train.jsonl"), "images_file": up("images.zip")}
        hp = {"batch_size": 4, "max_steps": STEPS, "checkpoint_interval": INTERVAL}
        job = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **files, "seed": 3, "hyperparameters": hp})
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        wait_for(lambda: c.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "running", what="a worker")
        stack.start_worker(home=tmp_path / "worker1")  # another machine, empty cache: waits while it starts
        ckpts = wait_for(
            lambda: c.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"],
            interval=0.05,
            what="first checkpoint",
        )
        stack.kill_worker(stack.workers[0])  # SIGKILL: no clean-up, no ack
        killed_at = max(ck["step_number"] for ck in ckpts)
        assert killed_at < STEPS, "the job ended before the worker was killed"
        assert c.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "running"  # until the lease runs out
        done = finished(c, job_id)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempt"] == 2
        events = all_events(c, job_id)
        resumed = [e["data"]["step"] for e in events if e["message"].startswith("Resumed from the checkpoint")]
        assert resumed and resumed[0] >= killed_at
        assert sorted(e["data"]["step"] for e in events if e["type"] == "metrics") == list(range(1, STEPS + 1))
        requeued = "The worker stopped responding; the job is queued again and resumes from its last checkpoint"
        assert requeued in [e["message"] for e in events]

        adapter = c.get(f"/v1/fine_tuning/jobs/{job_id}/adapter")
        assert adapter.status_code == 200
        zf = zipfile.ZipFile(io.BytesIO(adapter.content))
        assert zf.testzip() is None
        assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(zf.namelist())
        ckpt = c.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"][0]
        one = c.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/adapter")
        assert one.status_code == 200
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(
            zipfile.ZipFile(io.BytesIO(one.content)).namelist()
        )

    # Everything lives in the bucket: the uploads by their hash, the checkpoints, the adapter
    keys = s3_server.keys(bucket, "kiln/")
    sha = hashlib.sha256((sample / "train.jsonl").read_bytes()).hexdigest()
    assert f"kiln/objects/{sha[:2]}/{sha}" in keys
    art = f"kiln/artifacts/jobs/{job_id}"
    body = s3_server.client().get_object(Bucket=bucket, Key=f"{art}/adapter.zip")["Body"].read()
    assert body == adapter.content
    steps = {k.split("/")[5] for k in keys if k.startswith(f"{art}/checkpoints/")}
    assert steps == {f"step-{s:07d}" for s in range(INTERVAL, STEPS + 1, INTERVAL)}

    # ... and no process used a store folder; the second worker fetched the checkpoint it resumed
    # from out of the bucket, into its own cache
    homes = [stack.home, stack.worker_home, tmp_path / "worker1"]
    assert not any((h / "store").exists() for h in homes)
    first = f"artifacts/jobs/{job_id}/checkpoints/step-{resumed[0]:07d}/trainer_state.pt"
    assert (tmp_path / "worker1" / "store-cache" / first).is_file()
    assert (tmp_path / "worker1" / "store-cache" / "etags" / first).is_file()  # its ETag, as fetched
    assert (stack.home / "store-cache" / "objects" / sha[:2] / sha).is_file()  # the API's copy of its upload
