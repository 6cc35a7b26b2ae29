"""A fine-tuned model's merged export: its base with the adapter folded into the weights, in the
family's on-disk layout, zipped (``engine/tools/export.py`` makes the folder). The API has no
torch, so a training worker makes it (task ``EXPORT_TASK``, on the training queue: an export
waits behind the jobs before it); the API starts it, shows its state and serves the archive.

The state lives in the store beside the job's artifacts, no table: ``jobs/<job>/export.json``
(status, times, the worker's token and heartbeat, what was written, or the error) and
``jobs/<job>/merged.zip``, published atomically once complete. Each is replaced whole (a rename),
so a reader never sees half of one. One export per fine-tuned model: its id comes from the job's.

    (none) -> queued -> running -> succeeded | failed;  failed -> queued (a POST starts it again)

A worker that dies mid-export stops its heartbeat: after ``lease_seconds`` the export shows as
failed (``worker_lost``) and a POST starts it again; a POST on an export queued longer than
``requeue_queued_after_seconds`` sends its message again (the broker may have lost it). The task
is safe to run twice: a finished export is left alone, and one another worker holds (fresh
heartbeat) is not taken.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api import queue
from api.catalog import BASE_MODELS
from api.errors import Conflict, Invalid, not_found
from api.models import Job, now
from api.settings import get_settings
from kiln.store import ObjectStore

EXPORT_TASK = "kiln.export_model"
log = logging.getLogger("kiln.exports")


def state_key(job_id: str) -> str:
    return f"jobs/{job_id}/export.json"


def archive_key(job_id: str) -> str:
    return f"jobs/{job_id}/merged.zip"


def read(store: ObjectStore, job_id: str) -> dict[str, Any] | None:
    path = store.path(state_key(job_id))
    return json.loads(path.read_text()) if path.exists() else None


def write(store: ObjectStore, job_id: str, state: dict[str, Any]) -> None:
    with store.publish_file(state_key(job_id)) as tmp:
        tmp.write_text(json.dumps(state))


def status(store: ObjectStore, state: dict[str, Any]) -> dict[str, Any]:
    """The state as it stands: a running export whose worker stopped beating is failed."""
    if state["status"] == "running" and time.time() - state["heartbeat_at"] > get_settings().lease_seconds:
        message = "the worker stopped while exporting (no heartbeat); POST /v1/models/{model}/export starts it again"
        return {**state, "status": "failed", "error": {"code": "worker_lost", "message": message, "param": None}}
    if state["status"] == "succeeded" and not store.exists(archive_key(state["job_id"])):
        message = "the archive is missing from the store; POST /v1/models/{model}/export makes it again"
        return {**state, "status": "failed", "error": {"code": "archive_missing", "message": message, "param": None}}
    return state


def public(job: Job, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "export-" + job.id.removeprefix("ftjob-"),
        "object": "model.export",
        "model": job.fine_tuned_model,
        "base_model": job.model,
        "fine_tuning_job_id": job.id,
        "status": state["status"],
        "created_at": state["created_at"],
        "finished_at": state.get("finished_at"),
        "format": "safetensors",
        "bytes": state.get("bytes"),
        "model_type": state.get("model_type"),
        "dtypes": state.get("dtypes", []),
        "error": state.get("error"),
    }


# ---- the API's side ----------------------------------------------------------------------------
def fine_tuned(session: Session, owner: str, model_id: str) -> Job:
    """The owner's succeeded job whose fine-tuned model is ``model_id``; another owner's is not found."""
    if model_id in BASE_MODELS:
        raise Invalid(
            f"{model_id} is a base model: there is no adapter to merge; export a fine-tuned model (ft:…)",
            param="model",
            code="not_a_fine_tuned_model",
        )
    job = session.scalar(
        select(Job).where(Job.owner == owner, Job.fine_tuned_model == model_id, Job.status == "succeeded")
    )
    if job is None or not job.adapter_key:
        raise not_found("model", model_id)
    return job


def start(session: Session, store: ObjectStore, owner: str, model_id: str) -> dict[str, Any]:
    """Start the model's export, or answer with the one already made or under way (a failed one
    starts again). Only the job id travels to the worker."""
    job = fine_tuned(session, owner, model_id)
    state = read(store, job.id)
    if state is not None and status(store, state)["status"] != "failed":
        waited = time.time() - state.get("sent_at", 0.0)
        if state["status"] != "queued" or waited < get_settings().requeue_queued_after_seconds:
            return public(job, status(store, state))
        # queued a while: its message may be lost; a second one is harmless (the task is idempotent)
    else:
        state = {"job_id": job.id, "status": "queued", "created_at": now()}
    state = {**state, "sent_at": time.time()}
    write(store, job.id, state)
    try:
        queue.client().send_task(EXPORT_TASK, args=[job.id], queue=get_settings().queue)
    except Exception:
        log.exception("could not send the export of %s", job.id)
        message = "the export could not be queued (the broker is unreachable); POST again to retry"
        state = {**state, "status": "failed", "error": {"code": "queue_unavailable", "message": message, "param": None}}
        write(store, job.id, state)
    return public(job, state)


def get(session: Session, store: ObjectStore, owner: str, model_id: str) -> dict[str, Any]:
    job = fine_tuned(session, owner, model_id)
    state = read(store, job.id)
    if state is None:
        raise not_found("export", model_id)
    return public(job, status(store, state))


def archive(session: Session, store: ObjectStore, owner: str, model_id: str) -> Path:
    """The finished export's zip; a 409 until it has succeeded."""
    export = get(session, store, owner, model_id)
    if export["status"] != "succeeded":
        raise Conflict(
            f"The export of {model_id} is {export['status']}: the archive is ready once it has succeeded "
            "(GET /v1/models/{model}/export shows its state)",
            "export_not_ready",
        )
    return store.path(archive_key(export["fine_tuning_job_id"]))


# ---- the worker's side (workers/exports.py) -------------------------------------------------------
def claim(store: ObjectStore, job_id: str, token: str) -> bool:
    """Take the export to make it: not when it has succeeded, nor while another worker holds it."""
    state = read(store, job_id) or {"job_id": job_id, "created_at": now()}
    current = status(store, state) if "status" in state else {"status": "queued"}
    if current["status"] == "succeeded" or (current["status"] == "running" and state.get("token") != token):
        return False
    t = time.time()
    write(store, job_id, {**state, "status": "running", "token": token, "started_at": now(), "heartbeat_at": t})
    return True


def beat(store: ObjectStore, job_id: str, token: str) -> bool:
    """Refresh the heartbeat while the export is this worker's; False once it is not."""
    state = read(store, job_id)
    if state is None or state.get("token") != token or state["status"] != "running":
        return False
    write(store, job_id, {**state, "heartbeat_at": time.time()})
    return True


def finish(store: ObjectStore, job_id: str, token: str, **result: Any) -> None:
    """Record the outcome: ``status`` succeeded (with ``bytes``, ``model_type``, ``dtypes``) or
    failed (with ``error``)."""
    state = read(store, job_id) or {"job_id": job_id, "created_at": now()}
    write(store, job_id, {**state, "error": None, **result, "token": token, "finished_at": now()})
