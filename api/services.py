"""Queries and state changes behind the routes. Routes stay thin; this is where rules live."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api import catalog, lifecycle, queue
from api.datasets import check_dataset, image_problem, open_source, raise_if_bad
from api.errors import Conflict, Invalid, not_found
from api.estimate import estimate
from api.models import TERMINAL_STATES, Checkpoint, File, IdempotencyRecord, Job, JobEvent, now
from api.settings import Settings
from kiln.catalog import CARDS, ModelCard
from kiln.chat import ChatRequest, ImagePart
from kiln.dataset import LengthBound, Report, decode_data_url, method_takes, parse_prompt
from kiln.spec import JobRequest, resolve
from kiln.store import ObjectStore


# ---- lists -------------------------------------------------------------------------------
def paginate(session: Session, stmt, model, after: str | None, limit: int, newest_first: bool = True):
    """One page after the cursor ``after`` (an object's id), newest first unless ``newest_first``
    is False; (rows, has_more)."""
    if after:
        cursor = session.scalar(select(model.pk).where(model.id == after))
        if cursor is None:
            raise not_found("object", after, param="after")
        stmt = stmt.where(model.pk < cursor if newest_first else model.pk > cursor)
    stmt = stmt.order_by(model.pk.desc() if newest_first else model.pk.asc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


# ---- idempotency -----------------------------------------------------------------------------
def fingerprint(owner: str, endpoint: str, *parts: str) -> str:
    """What makes two requests the same: owner, method and path, and the request's content."""
    return hashlib.sha256("\n".join((owner, endpoint, *parts)).encode()).hexdigest()


def replay(session: Session, owner: str, key: str | None, endpoint: str, fp: str) -> JSONResponse | None:
    """The stored answer to an earlier request with this Idempotency-Key (kept 24 hours), if there
    was one; the same key with another request is a 409."""
    if not key:
        return None
    found = session.execute(
        select(IdempotencyRecord.status_code, IdempotencyRecord.body, IdempotencyRecord.fingerprint).where(
            IdempotencyRecord.owner == owner,
            IdempotencyRecord.key == key,
            IdempotencyRecord.endpoint == endpoint,
            IdempotencyRecord.expires_at > now(),
        )
    ).first()
    session.rollback()  # hold no connection while an upload streams in
    if found is None:
        return None
    if found.fingerprint != fp:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used for a different request to {endpoint} in the last 24 "
            "hours; send a new key for a new request",
            code="idempotency_key_reused",
        )
    return JSONResponse(found.body, status_code=found.status_code)


def remember(session: Session, owner: str, key: str | None, endpoint: str, fp: str, status: int, body: dict) -> None:
    """Keep the answer for 24 hours (in the caller's transaction); expired keys are dropped here."""
    if key:
        session.execute(delete(IdempotencyRecord).where(IdempotencyRecord.expires_at <= now()))
        session.add(
            IdempotencyRecord(owner=owner, key=key, endpoint=endpoint, fingerprint=fp, status_code=status, body=body)
        )


def idempotent(
    session: Session, owner: str, key: str | None, endpoint: str, request: str, make: Callable[[], dict]
) -> dict | JSONResponse:
    """Answer a JSON POST once per Idempotency-Key: the stored answer when the same request came
    before, else ``make()``'s (its writes committed with the key's record; the same key sent twice
    at once: the request that lost the race gets the winner's answer)."""
    fp = fingerprint(owner, endpoint, request)
    prior = replay(session, owner, key, endpoint, fp)
    if prior:
        return prior
    body = make()
    remember(session, owner, key, endpoint, fp, 200, body)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        prior = replay(session, owner, key, endpoint, fp)
        if prior is None:
            raise
        return prior
    return body


# ---- files -----------------------------------------------------------------------------------
def get_file(session: Session, owner: str, file_id: str) -> File:
    f = session.scalar(select(File).where(File.id == file_id, File.owner == owner, File.deleted_at.is_(None)))
    if f is None:
        raise not_found("file", file_id)
    return f


def delete_file(session: Session, store: ObjectStore, owner: str, file_id: str) -> None:
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
        raise not_found("file", file_id, param=param)
    if f.kind not in kinds or (param != "images_file" and not f.stats.get("examples")):
        want = "a zip of images" if param == "images_file" else "a JSONL dataset (or a zip holding one)"
        raise Invalid(f"{param} {file_id!r} is not {want}", param=param, code=f"invalid_{param}")
    return f


def dataset_report(
    store: ObjectStore,
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
            tokenize=catalog.token_counter(model, store.model_dir(model, weights=False)),
            length=length,
        )
    finally:
        source.close()


def report_public(
    session: Session, report: Report, f: File, model: str, length: LengthBound, n_epochs: int
) -> dict[str, Any]:
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
        "estimate": {"n_epochs": n_epochs, "training_tokens": training, **estimate(session, model, training)},
    }


def check_model(model: str, param: str = "model") -> ModelCard:
    if model not in CARDS:
        raise Invalid(
            f"Model {model!r} is not available for fine-tuning; available: {', '.join(CARDS)}",
            param=param,
            code="model_not_available",
        )
    return CARDS[model]


def find_fine_tune(session: Session, owner: str, model: str) -> tuple[Job, Checkpoint | None, bool] | None:
    """The owner's job a fine-tuned model's name points at, the checkpoint it names, and whether
    it names the job's final model. A checkpoint's id (``ftckpt_...``) or name
    (``ft:...:ckpt-step-N``): that checkpoint (None when the job has no such step). ``ft:...``
    (the job's ``fine_tuned_model``, or a running job's ``ft:<model>:<owner>::<job id>``): its
    last checkpoint (None when it has none yet). None: no such job of this owner (another
    owner's is not found either)."""
    if model.startswith("ftckpt_"):
        found = session.execute(
            select(Checkpoint, Job)
            .join(Job, Job.id == Checkpoint.job_id)
            .where(Checkpoint.id == model, Job.owner == owner)
        ).first()
        return None if found is None else (found[1], found[0], False)
    name, _, step = model.partition(":ckpt-step-")
    named = (Job.fine_tuned_model == name) | (Job.id == name.rsplit(":", 1)[-1])  # or a running job's
    job = session.scalar(select(Job).where(Job.owner == owner, named))
    if job is None:
        return None
    if step and not step.isdigit():
        return job, None, False
    query = select(Checkpoint).where(Checkpoint.job_id == job.id)
    query = query.where(Checkpoint.step == int(step)) if step else query.order_by(Checkpoint.step.desc())
    return job, session.scalar(query.limit(1)), not step


def start_point(session: Session, owner: str, model: str) -> tuple[ModelCard, dict[str, Any] | None]:
    """The base model a job trains, and where it starts when ``model`` is one of the owner's
    fine-tunes: ``ft:...`` (its final adapter, a fresh optimizer) or a checkpoint, by id
    (``ftckpt_...``) or by name (``ft:...:ckpt-step-N``: the whole training state, so the job
    continues exactly as the earlier one would have). Another owner's is not found."""
    if model in CARDS or not model.startswith(("ft:", "ftckpt_")):
        return check_model(model), None
    found = find_fine_tune(session, owner, model)
    parent, ckpt, final = found or (None, None, False)
    if parent is None or ckpt is None or (final and parent.status != "succeeded"):
        raise not_found("model", model, param="model")
    start: dict[str, Any] = {"model": model, "job": parent.id, "lora": parent.lora}
    if final:  # the final adapter: its weights only
        return CARDS[parent.model], {**start, "adapter": ckpt.store_key}
    return CARDS[parent.model], {**start, "checkpoint": ckpt.store_key, "step": ckpt.step}


@dataclass(frozen=True)
class ChatModel:
    """What answers a chat request: a base model, and the adapter on it (the store key of a
    checkpoint folder in the PEFT layout; None: the base model alone)."""

    card: ModelCard
    adapter: str | None


def chat_model(session: Session, owner: str, model: str) -> ChatModel:
    """A chat request's model: a base model of the catalog, or one of the owner's fine-tuned
    models or checkpoints. Another owner's or an unknown ``ft:`` name is a 404; a fine-tune whose
    job has not succeeded (it has no final adapter yet) a 409; any other name a 400 listing the
    models."""
    if model in CARDS:
        return ChatModel(CARDS[model], None)
    if not model.startswith(("ft:", "ftckpt_")):
        raise Invalid(
            f"model: {model!r} is not a model; models: {', '.join(CARDS)}, and your fine-tuned models "
            "(ft:..., as GET /v1/models lists them) and their checkpoints",
            param="model",
            code="model_not_found",
        )
    found = find_fine_tune(session, owner, model)
    if found is None:
        raise not_found("model", model, param="model")
    job, ckpt, final = found
    if final and job.status != "succeeded":
        raise Conflict(
            f"model: {model} is the model of job {job.id}, which is {job.status}: it answers once the job has "
            "succeeded (its checkpoints, ...:ckpt-step-N, answer as soon as they are saved)",
            code="model_not_ready",
            param="model",
        )
    if ckpt is None:
        raise not_found("model", model, param="model")
    return ChatModel(CARDS[job.model], ckpt.store_key)


def check_chat(req: ChatRequest, card: ModelCard, max_pixels: int) -> None:
    """What the API checks of a chat request before the inference server sees it (the server
    alone counts the prompt's tokens: a prompt plus max_tokens over the position limit is its
    400): the messages as a prompt (kiln.dataset.parse_prompt), images on a text-only model and
    images that do not decode (or have more than ``max_pixels``), a max_tokens that alone leaves
    no room in the position limit, stream_options without stream."""
    req.check_stream_options()
    limit, param = req.completion_limit()
    example, issues = parse_prompt([m.model_dump(exclude_none=True) for m in req.messages])
    if example is None:
        text = "; ".join(f"{i.field}: {i.message}" for i in issues[:5])
        raise Invalid(text, param=issues[0].field, code="invalid_messages")
    model = card.name if req.model == card.name else f"{req.model} (on {card.name})"
    images = [
        (f"messages[{i}].content[{j}]", part.image_url.url)
        for i, m in enumerate(req.messages)
        for j, part in enumerate(m.content if isinstance(m.content, list) else [])
        if isinstance(part, ImagePart)
    ]
    if images and card.image_tokens is None:
        takes = ", ".join(c.name for c in CARDS.values() if c.image_tokens is not None)
        raise Invalid(
            f"{images[0][0]}: {model} takes no image input (a text-only model); models that do: {takes}",
            param=images[0][0],
            code="images_not_supported",
        )
    for where, url in images:
        problem = image_problem(decode_data_url(url), max_pixels)
        if problem:
            raise Invalid(f"{where}.image_url.url: {problem}", param=f"{where}.image_url.url", code="invalid_image")
    if limit is not None and card.position_limit is not None and limit >= card.position_limit:
        raise Invalid(
            f"{param}: {limit} leaves no room for the prompt in {model}'s position limit of {card.position_limit} "
            "tokens (prompt and answer together)",
            param=param,
            code="max_tokens_too_large",
        )


def create_job(session: Session, store: ObjectStore, settings: Settings, owner: str, req: JobRequest) -> Job:
    """Check the request against the model and the datasets, and store it as asked and as
    resolved (kiln.spec.resolve); the job is queued once the caller commits and ``start_job``s."""
    card, parent = start_point(session, owner, req.model)
    train = _dataset_file(session, owner, req.training_file, "training_file", ("jsonl", "zip"))
    assert train is not None  # training_file is required
    valid = _dataset_file(session, owner, req.validation_file, "validation_file", ("jsonl", "zip"))
    images = _dataset_file(session, owner, req.images_file, "images_file", ("zip",))
    requested: dict[str, Any] = {
        "hyperparameters": req.requested_hyperparameters(),
        "lora": req.lora.model_dump(exclude_unset=True) if req.lora else {},
        "method": req.method_type,
        "integrations": [i.model_dump() for i in req.integrations or []],
    }
    if any(i["type"] == "mlflow" for i in requested["integrations"]) and not settings.mlflow_tracking_uri:
        raise Invalid(
            "integrations: this server has no MLflow tracking server configured (KILN_MLFLOW_TRACKING_URI)",
            param="integrations",
            code="integration_unavailable",
        )
    lora = requested["lora"]
    if parent is not None:  # the adapter goes on training: the earlier job's, as it was
        changed = sorted(k for k, v in lora.items() if parent["lora"].get(k) != v)
        if changed:
            raise Invalid(
                f"lora.{changed[0]}: a job continued from {req.model} keeps its adapter's settings "
                f"({json.dumps(parent['lora'][changed[0]])}); leave lora out",
                param=f"lora.{changed[0]}",
            )
        lora = parent.pop("lora")
        requested["from"] = parent
    resolved = resolve(card, requested["hyperparameters"], lora, req.method_type)
    length = catalog.length_bound(card.name, requested["hyperparameters"].get("max_seq_len"))
    for f, param in ((train, "training_file"), (valid, "validation_file")):
        if f is not None:
            kind = f.stats.get("format", "chat")
            wrong = method_takes(req.method_type, kind == "preference")
            if wrong:
                raise Invalid(f"{param} {f.id} holds {kind} examples; {wrong}", param=param, code=f"invalid_{param}")
            report = dataset_report(store, settings, f, images, card.name, length, param)
            raise_if_bad(report, param, f"{param} {f.id}")

    job = Job(
        owner=owner,
        model=card.name,
        training_file=train.id,
        validation_file=valid.id if valid else None,
        images_file=images.id if images else None,
        hyperparameters=resolved.hyperparameters.model_dump(),
        lora=resolved.lora.model_dump(),
        requested=requested,
        suffix=req.suffix,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
        meta=req.metadata,
    )
    lifecycle.create(session, job, train.stats.get("examples"))
    return job


def start_job(session: Session, job: Job) -> None:
    """Commit done: hand the job to the queue (only the id travels)."""
    lifecycle.sent(session, job.id, queue.enqueue(job.id))
    session.commit()


def cancel_job(session: Session, owner: str, job_id: str) -> Job:
    job = get_job(session, owner, job_id)
    lifecycle.cancel(session, job)
    session.commit()
    session.refresh(job)
    return job


def pause_job(session: Session, owner: str, job_id: str) -> Job:
    job = get_job(session, owner, job_id)
    lifecycle.pause(session, job)
    session.commit()
    session.refresh(job)
    return job


def resume_job(session: Session, owner: str, job_id: str) -> Job:
    job = get_job(session, owner, job_id)
    if lifecycle.resume(session, job):
        session.commit()
        start_job(session, job)
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
