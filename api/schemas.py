"""The public JSON shape of each object (OpenAI's fields). Request bodies are ``kiln.spec``'s (the
job contract, shared with the SDK and the engine); response models are ``kiln.types``'."""

from __future__ import annotations

from typing import Any

from api.models import Checkpoint, File, Job, JobEvent


def file_public(f: File) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": f.status,
        "status_details": f.status_details,
        "expires_at": None,
        "stats": f.stats,
    }


def job_public(j: Job) -> dict[str, Any]:
    hp = {k: j.hyperparameters.get(k, "auto") for k in ("n_epochs", "batch_size", "learning_rate_multiplier")}
    extras = {k: v for k, v in j.hyperparameters.items() if k not in hp}
    method = j.requested.get("method", "supervised")
    return {
        "id": j.id,
        "object": "fine_tuning.job",
        "created_at": j.created_at,
        "error": j.error,
        "fine_tuned_model": j.fine_tuned_model,
        "finished_at": j.finished_at,
        "hyperparameters": hp,
        "model": j.model,
        "organization_id": j.owner,
        "result_files": [],
        "seed": j.seed,
        "status": j.status,
        "trained_tokens": j.trained_tokens,
        "training_file": j.training_file,
        "validation_file": j.validation_file,
        "estimated_finish": None,
        "integrations": j.requested.get("integrations", []),
        "metadata": j.meta,
        "suffix": j.suffix,
        "method": {"type": method, method: {"hyperparameters": {**hp, **extras}}},
        # Kiln extras
        "images_file": j.images_file,
        "lora": j.lora,
        "started_at": j.started_at,
        "requested": j.requested,
        "cancel_requested": j.cancel_requested,
        "attempt": j.attempt,
    }


def event_public(e: JobEvent) -> dict[str, Any]:
    return {
        "id": e.id,
        "object": "fine_tuning.job.event",
        "created_at": e.created_at,
        "level": e.level,
        "message": e.message,
        "data": e.data,
        "type": e.type,
    }


def checkpoint_public(c: Checkpoint, job: Job) -> dict[str, Any]:
    base = job.fine_tuned_model or f"ft:{job.model}:{job.owner}::{job.id}"
    return {
        "id": c.id,
        "object": "fine_tuning.job.checkpoint",
        "created_at": c.created_at,
        "fine_tuned_model_checkpoint": f"{base}:ckpt-step-{c.step}",
        "fine_tuning_job_id": job.id,
        "metrics": {"step": c.step, **c.metrics},
        "step_number": c.step,
    }


def page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "has_more": has_more,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
    }
