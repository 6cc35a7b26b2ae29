"""A fine-tuned model's merged export through the real service: PostgreSQL, Redis, the API under
uvicorn and a Celery worker process that merges. Fine-tune kiln-tiny briefly, export (queued
behind a running job, so its 409 is certain), download with the SDK and the CLI, unpack, and load
the folder with load_base: it gives the base + downloaded adapter's logits."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

import kiln
from kiln import cli as kiln_cli
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def client(pg_stack):
    with kiln.Client(pg_stack.base_url, pg_stack.keys["alice"], backoff=0.05) as c:
        yield c


def test_export_download_and_load(client, pg_stack, sample, tmp_path):
    from engine.lora import apply_lora, load_adapter
    from engine.model.registry import load_base
    from engine.tools.export import lora_spec

    train = client.files.upload(sample / "train.jsonl")
    images = client.files.upload(sample / "images.zip")
    job = client.jobs.create(
        "kiln-tiny", train.id, images_file=images.id, hyperparameters={"max_steps": 3}, lora={"rank": 4}
    )
    job = client.jobs.wait(job.id)
    assert job.status == "succeeded" and job.fine_tuned_model
    model = job.fine_tuned_model
    path = f"/v1/models/{model}/export"

    # the one worker busy with a long job: the export waits in the queue behind it
    busy = client.jobs.create("kiln-tiny", train.id, images_file=images.id, hyperparameters={"max_steps": 500})
    wait_for(lambda: client.jobs.get(busy.id).status == "running", what="the long job to run")
    with pg_stack.client() as c:
        r = c.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "export_not_found"
        first = c.post(path)
        assert first.status_code == 202, first.text
        export = first.json()
        assert export["status"] == "queued" and export["model"] == model and export["base_model"] == "kiln-tiny"
        again = c.post(path)
        assert again.status_code == 202 and again.json()["id"] == export["id"]  # the same export
        assert c.get(path).json()["status"] == "queued"
        r = c.get(path + "/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "export_not_ready"
        r = c.post("/v1/models/kiln-tiny/export")
        assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
        assert c.get(f"/v1/models/{model}").json()["id"] == model  # the catch-all route still answers
    with pg_stack.client("bob") as c:
        for method, p in (("POST", path), ("GET", path), ("GET", path + "/content")):
            r = c.request(method, p)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (method, p)
    client.jobs.cancel(busy.id)

    done = client.exports.wait(model, interval=0.5, timeout=240)
    assert done.status == "succeeded", done.error
    assert done.id == export["id"] and done.model_type == "kiln_tiny" and done.dtypes == ["float32"]
    assert client.exports.create(model).finished_at == done.finished_at  # made once
    merged_zip = client.exports.download(model, tmp_path / "merged.zip")
    assert merged_zip.stat().st_size == done.bytes
    rc = kiln_cli.main(
        [
            "--base-url",
            pg_stack.base_url,
            "--api-key",
            pg_stack.keys["alice"],
            "export",
            model,
            "-o",
            str(tmp_path / "cli.zip"),
        ]
    )
    assert rc == 0 and (tmp_path / "cli.zip").read_bytes() == merged_zip.read_bytes()

    folder = tmp_path / "merged"
    with zipfile.ZipFile(merged_zip) as zf:
        assert sorted(zf.namelist()) == ["config.json", "model.safetensors"]
        zf.extractall(folder)
    adapter = tmp_path / "adapter"
    with zipfile.ZipFile(client.adapters.download(job.id, tmp_path / "adapter.zip")) as zf:
        zf.extractall(adapter)
    base_dir = Path(pg_stack.store) / "models" / "kiln-tiny"
    assert json.loads((folder / "config.json").read_text()) == json.loads((base_dir / "config.json").read_text())

    reference = load_base(base_dir).eval()
    apply_lora(reference, lora_spec(adapter))
    load_adapter(reference, adapter)
    merged = load_base(folder).eval()
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, plain = reference(ids), merged(ids), load_base(base_dir).eval()(ids)
    assert float((want - plain).norm() / plain.norm()) > 1e-2  # three steps moved the model
    assert float((got - want).norm() / want.norm()) < 1e-5
