"""/v1/files: upload (streamed, validated, content-addressed), list, retrieve, delete, content."""

from __future__ import annotations

import zipfile

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import catalog, services
from api.auth import current_owner
from api.datasets import check_archive, check_dataset, open_source, raise_if_bad
from api.deps import get_session, get_store
from api.errors import ApiError
from api.models import File
from api.schemas import file_public, page
from api.settings import get_settings
from api.uploads import receive
from kiln.store import LocalStore, Upload

router = APIRouter()
PURPOSES = ("fine-tune",)


def _validate_upload(upload: Upload, filename: str) -> tuple[str, dict]:
    """Check a received file before it is kept. Returns (kind, stats)."""
    settings = get_settings()
    with open(upload.path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    if is_zip:
        check_archive(upload.path, settings)
        with zipfile.ZipFile(upload.path) as zf:
            has_jsonl = any(n.endswith(".jsonl") for n in zf.namelist())
        if not has_jsonl:  # an archive of images for a JSONL uploaded beside it
            return "zip", {"examples": 0}
    elif not filename.endswith((".jsonl", ".json", ".txt")) and filename:
        raise ApiError(
            400,
            f"Unsupported file type {filename!r}: upload a .jsonl dataset or a .zip archive",
            param="file",
            code="unsupported_file",
        )
    source = open_source(upload.path, None, "file")
    try:
        report = check_dataset(source, settings, check_paths=is_zip)
    finally:
        source.close()
    raise_if_bad(report, "file", f"dataset {filename!r}")
    return ("zip" if is_zip else "jsonl"), report.stats()


def _store_file(
    session: Session, store: LocalStore, owner: str, upload: Upload, filename: str, purpose: str, idem: str | None
) -> dict:
    try:
        kind, stats = _validate_upload(upload, filename)
        sha, created = upload.commit()
    except BaseException:
        upload.abort()
        raise
    f = File(
        owner=owner,
        filename=filename or "upload",
        purpose=purpose,
        kind=kind,
        bytes=upload.size,
        sha256=sha,
        status="processed",
        stats=stats,
    )
    try:
        session.add(f)
        session.flush()
        body = file_public(f)
        services.remember(session, owner, idem, "POST /v1/files", 200, body)
        session.commit()
    except BaseException:
        session.rollback()
        if created and session.scalar(select(File.pk).where(File.sha256 == sha).limit(1)) is None:
            store.delete_object(sha)
        raise
    return body


UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(PURPOSES)},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", openapi_extra=UPLOAD_BODY)
async def upload_file(
    request: Request,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: LocalStore = Depends(get_store),
    idem: str | None = Header(None, alias="Idempotency-Key"),
):
    prior = await run_in_threadpool(services.replay, session, owner, idem, "POST /v1/files")
    if prior:
        return prior
    received = await receive(request, store, get_settings().max_upload_bytes)
    assert received.upload is not None  # receive() answers 400 when the form has no file part
    purpose = received.fields.get("purpose", "")
    if purpose not in PURPOSES:
        received.upload.abort()
        raise ApiError(
            400,
            f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}",
            param="purpose",
            code="invalid_purpose",
        )
    return await run_in_threadpool(
        _store_file, session, store, owner, received.upload, received.filename, purpose, idem
    )


@router.get("/v1/files")
def list_files(
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(100),
):
    stmt = select(File).where(File.owner == owner, File.deleted_at.is_(None))
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    rows, more = services.paginate(session, stmt, File, after, limit)
    return page([file_public(f) for f in rows], more)


@router.get("/v1/files/{file_id}")
def retrieve_file(file_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return file_public(services.get_file(session, owner, file_id))


@router.delete("/v1/files/{file_id}")
def delete_file(
    file_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: LocalStore = Depends(get_store),
):
    services.delete_file(session, store, owner, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/v1/files/{file_id}/report")
def file_report(
    file_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: LocalStore = Depends(get_store),
    model: str = "kiln-tiny",
    images_file: str | None = None,
    max_seq_len: int | None = Query(None, ge=16, le=1 << 20),
    n_epochs: int = Query(3, ge=1, le=50),
):
    """The validation report of a dataset for a base model, before any job: problems by line and
    field, token counts and their histogram, and the training tokens and time to expect."""
    if model not in catalog.BASE_MODELS:
        raise ApiError(
            400,
            f"Model {model!r} is not available; available: {', '.join(catalog.BASE_MODELS)}",
            param="model",
            code="model_not_available",
        )
    f = services.get_file(session, owner, file_id)
    if f.kind == "zip" and not f.stats.get("examples"):
        raise ApiError(400, f"{file_id} is an archive of images, not a dataset", param="file_id")
    images = services.get_file(session, owner, images_file) if images_file else None
    length = catalog.length_bound(model, max_seq_len, "max_seq_len")
    report = services.dataset_report(store, get_settings(), f, images, model, length)
    return services.report_public(report, f, model, length, n_epochs)


@router.get("/v1/files/{file_id}/content")
def file_content(
    file_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: LocalStore = Depends(get_store),
):
    f = services.get_file(session, owner, file_id)
    media = "application/zip" if f.kind == "zip" else "application/jsonl"
    return FileResponse(store.object_path(f.sha256), media_type=media, filename=f.filename)
