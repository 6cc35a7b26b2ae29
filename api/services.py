"""Queries and state changes behind the routes. Routes stay thin; this is where rules live."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi.responses import JSONResponse
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api import catalog, queue
from api.datasets import check_dataset, open_source, raise_if_bad
from api.errors import ApiError, not_found
from api.models import TERMINAL_STATES, Checkpoint, File, IdempotencyRecord, Job, JobEvent, now
from api.schemas import JobCreate, LoraSettings
from api.settings import Settings
from kiln.dataset import LengthBound, Report
from kiln.store import LocalStore


# ---- lists -------------------------------------------------------------------------------
def paginate(session: Session, stmt, model, after: str | None, limit: int, newest_first: bool = True):
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100", param="limit")
    if after:
        cursor = session.scalar(select(model.pk).where(model.id == after))
        if cursor is None:
            raise ApiError(400, f"Unknown cursor {after!r}", param="after")
        stmt = stmt.where(model.pk < cursor if newest_first else model.pk > cursor)
    stmt = stmt.order_by(model.pk.desc() if newest_first else model.pk.asc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


# ---- idempotency -----------------------------------------------------------------------------
def replay(session: Session, owner: str, key: str | None, endpoint: str) -> JSONResponse | None:
    """The stored answer to an earlier request with this Idempotency-Key, if there was one."""
    if not key:
        return None
    found = session.execute(
        select(IdempotencyRecord.status_code, IdempotencyRecord.body).where(
            IdempotencyRecord.owner == owner, IdempotencyRecord.key == key, IdempotencyRecord.endpoint == endpoint
        )
    ).first()
    session.rollback()  # hold no connection while an upload streams in
    return JSONResponse(found.body, status_code=found.status_code) if found else None


def remember(session: Session, owner: str, key: str | None, endpoint: str, status: int, body: dict) -> None:
    if key:
        session.add(IdempotencyRecord(owner=owner, key=key, endpoint=endpoint, status_code=status, body=body))


# ---- files -----------------------------------------------------------------------------------
def get_file(session: Session, owner: str, file_id: str) -> File:
    f = session.scalar(select(File).where(File.id == file_id, File.owner == owner, File.deleted_at.is_(None)))
    if f is None:
        raise not_found("file", file_id)
    return f


def delete_file(session: Session, store: LocalStore, owner: str, file_id: str) -> None:
    f = get_file(session, owner, file_id)
    f.deleted_at = now()
    session.flush()
    shared = session.scalar(select(File.pk).where(File.sha256 == f.sha256, File.deleted_at.is_(None)).limit(1))
    in_use = session.scalar(
        select(Job.pk)
        .where(
            Job.status.not_in(TERMINAL_STATES),
            (Job.training_file == f.id) | (Job.validation_file == f.id) | (Job.images_file == f.id),
        )
        .limit(1)
    )
    session.commit()
    if shared is None and in_use is None:
        store.delete_object(f.sha256)


# ---- jobs ------------------------------------------------------------------------------------
def add_event(
    session: Session, job_id: str, message: str, level: str = "info", type: str = "message", data: dict | None = None
) -> JobEvent:
    ev = JobEvent(job_id=job_id, message=message, level=level, type=type, data=data)
    session.add(ev)
    return ev


def get_job(session: Session, owner: str, job_id: str) -> Job:
    j = session.scalar(select(Job).where(Job.id == job_id, Job.owner == owner))
    if j is None:
        raise not_found("fine-tuning job", job_id)
    return j


def _dataset_file(session: Session, owner: str, file_id: str | None, param: str, kinds: tuple[str, ...]) -> File | None:
    if file_id is None:
        return None
    f = session.scalar(select(File).where(File.id == file_id, File.owner == owner, File.deleted_at.is_(None)))
    if f is None:
        raise ApiError(400, f"{param} {file_id!r} does not exist", param=param, code=f"invalid_{param}")
    if f.kind not in kinds or (param != "images_file" and not f.stats.get("examples")):
        want = "a zip of images" if param == "images_file" else "a JSONL dataset (or a zip holding one)"
        raise ApiError(400, f"{param} {file_id!r} is not {want}", param=param, code=f"invalid_{param}")
    return f


def dataset_report(
    store: LocalStore,
    settings: Settings,
    f: File,
    images: File | None,
    model: str,
    length: LengthBound,
    param: str = "file",
) -> Report:
    """One pass over a dataset: every line checked, every image opened, tokens counted with the
    model's tokenizer, examples over ``length`` flagged with what would fit."""
    source = open_source(store.object_path(f.sha256), store.object_path(images.sha256) if images else None, param)
    try:
        return check_dataset(
            source,
            settings,
            check_paths=True,
            tokenize=catalog.token_counter(model, store.root / "models"),
            length=length,
        )
    finally:
        source.close()


def report_public(report: Report, f: File, model: str, length: LengthBound, n_epochs: int) -> dict[str, Any]:
    stats = report.stats()
    training = (stats.get("tokens") or 0) * n_epochs
    return {
        "object": "dataset.report",
        "file_id": f.id,
        "model": model,
        "ok": report.ok,
        "issues": [{"line": i.line, "field": i.field, "message": i.message} for i in report.issues],
        "issues_truncated": report.truncated,
        "max_seq_len": length.bound,
        "position_limit": length.limit,
        "stats": stats,
        "estimate": {
            "n_epochs": n_epochs,
            "training_tokens": training,
            "seconds": round(training / catalog.BASE_MODELS[model]["tokens_per_second"], 1),
        },
    }


def create_job(session: Session, store: LocalStore, settings: Settings, owner: str, req: JobCreate) -> Job:
    if req.model not in catalog.BASE_MODELS:
        raise ApiError(
            400,
            f"Model {req.model!r} is not available for fine-tuning; available: {', '.join(catalog.BASE_MODELS)}",
            param="model",
            code="model_not_available",
        )
    if req.integrations:
        raise ApiError(400, "Integrations are not supported", param="integrations")
    hp = req.resolved_hyperparameters().model_dump(exclude_none=True)
    lora = (req.lora or LoraSettings()).model_dump()
    info = catalog.BASE_MODELS[req.model]
    lora["target_modules"] = lora["target_modules"] or list(info["default_targets"])
    lora["target_parameters"] = lora["target_parameters"] or []
    for field, allowed in (("target_modules", info["targets"]), ("target_parameters", info["parameters"])):
        unknown = [t for t in lora[field] if t not in allowed]
        if unknown:
            raise ApiError(
                400,
                f"lora.{field}: unknown name(s) {', '.join(unknown)} for {req.model}; "
                f"choose from {', '.join(allowed) or 'none'}",
                param=f"lora.{field}",
            )
    ep = hp.get("parallel", {}).get("ep_size", 1)
    if ep > 1 and (not info["experts"] or info["experts"] % ep):
        raise ApiError(
            400,
            f"hyperparameters.parallel.ep_size: {ep} does not divide the {info['experts']} experts "
            f"of {req.model}" + ("" if info["experts"] else " (it has none: use 1)"),
            param="hyperparameters.parallel.ep_size",
        )
    if hp.get("parallel", {}).get("cp_size", 1) > 1 and not info.get("context_parallel"):
        raise ApiError(
            400,
            f"hyperparameters.parallel.cp_size: {req.model} has no context-parallel form yet; use 1 "
            f"(models with one: {', '.join(m for m, i in catalog.BASE_MODELS.items() if i.get('context_parallel'))})",
            param="hyperparameters.parallel.cp_size",
        )
    train = _dataset_file(session, owner, req.training_file, "training_file", ("jsonl", "zip"))
    assert train is not None  # training_file is required
    valid = _dataset_file(session, owner, req.validation_file, "validation_file", ("jsonl", "zip"))
    images = _dataset_file(session, owner, req.images_file, "images_file", ("zip",))
    length = catalog.length_bound(req.model, hp.get("max_seq_len"))
    for f, param in ((train, "training_file"), (valid, "validation_file")):
        if f is not None:
            report = dataset_report(store, settings, f, images, req.model, length, param)
            raise_if_bad(report, param, f"{param} {f.id}")

    job = Job(
        owner=owner,
        model=req.model,
        training_file=train.id,
        validation_file=valid.id if valid else None,
        images_file=images.id if images else None,
        hyperparameters=hp,
        lora=lora,
        suffix=req.suffix,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
        meta=req.metadata,
        status="validating_files",
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, f"Validating training file: {train.id}")
    add_event(session, job.id, f"Files validated ({train.stats.get('examples')} examples), moving job to queued state")
    job.status = "queued"
    return job


def start_job(session: Session, job: Job) -> None:
    """Commit done: hand the job to the queue (only the id travels)."""
    if queue.enqueue(job.id):
        session.execute(update(Job).where(Job.id == job.id).values(enqueued_at=time.time()))
    else:  # the reaper sends queued jobs that have no enqueued_at
        add_event(session, job.id, "The queue could not be reached; the job will be sent again shortly", level="warn")
    session.commit()


def cancel_job(session: Session, owner: str, job_id: str) -> Job:
    job = get_job(session, owner, job_id)
    if job.status in TERMINAL_STATES:
        raise ApiError(409, f"Job {job_id} has already {job.status}", code="job_finished")
    if job.status in ("validating_files", "queued"):
        res = session.execute(
            update(Job)
            .where(Job.id == job.id, Job.status.in_(("validating_files", "queued")))
            .values(status="cancelled", finished_at=now(), cancel_requested=True)
        )
        if res.rowcount:  # type: ignore[attr-defined]  # an UPDATE's Result is a CursorResult
            add_event(session, job.id, "Job cancelled before it started")
    if not job.cancel_requested:
        session.execute(update(Job).where(Job.id == job.id).values(cancel_requested=True))
        add_event(session, job.id, "Cancellation requested; the job stops at the next step")
    session.commit()
    session.refresh(job)
    return job


def list_events(session: Session, job: Job, after: str | None, limit: int):
    return paginate(session, select(JobEvent).where(JobEvent.job_id == job.id), JobEvent, after, limit)


def events_since(session: Session, job_id: str, pk: int, limit: int = 500) -> list[JobEvent]:
    return list(
        session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.pk > pk).order_by(JobEvent.pk).limit(limit)
        )
    )


def list_checkpoints(session: Session, job: Job, after: str | None, limit: int):
    return paginate(session, select(Checkpoint).where(Checkpoint.job_id == job.id), Checkpoint, after, limit)


def get_checkpoint(session: Session, job: Job, ckpt_id: str) -> Checkpoint:
    c = session.scalar(select(Checkpoint).where(Checkpoint.id == ckpt_id, Checkpoint.job_id == job.id))
    if c is None:
        raise not_found("checkpoint", ckpt_id)
    return c


def models_for(session: Session, owner: str) -> list[dict[str, Any]]:
    out = [
        {"id": name, "object": "model", "created": m["created"], "owned_by": "kiln"}
        for name, m in catalog.BASE_MODELS.items()
    ]
    for j in session.scalars(
        select(Job)
        .where(Job.owner == owner, Job.status == "succeeded", Job.fine_tuned_model.is_not(None))
        .order_by(Job.pk)
    ):
        out.append(
            {
                "id": j.fine_tuned_model,
                "object": "model",
                "created": j.finished_at or j.created_at,
                "owned_by": owner,
                "root": j.model,
                "fine_tuning_job_id": j.id,
            }
        )
    return out
