"""The embedded defaults (SQLite database, Celery over SQLite, local store) run the same path
with no server but ours: the layout README's first command uses."""

from __future__ import annotations

import io
import zipfile

import openai

from tests.conftest import wait_for


def test_embedded_end_to_end(sqlite_stack, sample):
    oai = openai.OpenAI(base_url=f"{sqlite_stack.base_url}/v1", api_key=sqlite_stack.keys["alice"], max_retries=0)
    # One archive holding the JSONL and its images, the other accepted layout.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, zipfile.ZipFile(sample / "images.zip") as images:
        zf.writestr("shapes/train.jsonl", (sample / "train.jsonl").read_bytes())
        for name in images.namelist():
            zf.writestr(f"shapes/{name}", images.read(name))
    train = oai.files.create(file=("shapes.zip", buf.getvalue()), purpose="fine-tune")
    assert train.model_extra["stats"]["images"] > 0
    job = oai.fine_tuning.jobs.create(
        model="kiln-tiny", training_file=train.id, hyperparameters={"n_epochs": 1, "batch_size": 8}
    )
    done = wait_for(
        lambda: (j := oai.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j,
        timeout=240,
        what="embedded job",
    )
    assert done.status == "succeeded", done.error
    with sqlite_stack.client() as c:
        r = c.get(f"/v1/fine_tuning/jobs/{job.id}/adapter")
    assert r.status_code == 200
    assert "adapter_model.safetensors" in zipfile.ZipFile(io.BytesIO(r.content)).namelist()
    assert "Connected to sqla+sqlite" in sqlite_stack.log("worker0")


def test_quickstart_driver_runs_against_the_embedded_stack(sqlite_stack, tmp_path):
    """README's first command ends in scripts/quickstart.py: it must keep working, its chat
    question to the fine-tuned model included (the inference server beside the worker, as
    quickstart.sh starts it)."""
    import subprocess
    import sys
    from pathlib import Path

    sqlite_stack.start_inference()
    out = tmp_path / "adapter.zip"
    run = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[2] / "scripts" / "quickstart.py"),
            "--base-url",
            sqlite_stack.base_url,
            "--api-key",
            sqlite_stack.keys["bob"],
            "--out",
            str(out),
            "--epochs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "The job has successfully completed" in run.stdout and "adapter saved to" in run.stdout
    assert "asked ft:kiln-tiny:bob:quickstart:" in run.stdout and "What is 11 + 7? -> '" in run.stdout
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(zipfile.ZipFile(out).namelist())
