"""/v1/files: upload (streamed, validated, content-addressed), list, retrieve, delete, content."""

from __future__ import annotations

import zipfile
from typing import Literal

from fastapi import Depends, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import catalog, services
from api.auth import current_owner
from api.datasets import check_archive, check_dataset, open_source, raise_if_bad
from api.deps import Router, get_session, get_store
from api.errors import Invalid, responses
from api.models import File
from api.schemas import file_public, page
from api.settings import get_settings
from api.uploads import receive
from kiln.catalog import CARDS
from kiln.store import ObjectStore, Upload
from kiln.types import DatasetReport, FileDeleted, FileObject, ListOf

router = Router(tags=["files"])
UPLOAD = "POST /v1/files"
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
        raise Invalid(
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
    session: Session, store: ObjectStore, owner: str, upload: Upload, filename: str, purpose: str, idem: str | None
) -> dict | JSONResponse:
    fp = services.fingerprint(owner, UPLOAD, purpose, filename, upload.sha256())
    try:
        prior = services.replay(session, owner, idem, UPLOAD, fp)
        if prior is not None:  # the same upload again: the first answer, nothing stored twice
            upload.abort()
            return prior
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
        services.remember(session, owner, idem, UPLOAD, fp, 200, body)
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


@router.post(
    "/v1/files", openapi_extra=UPLOAD_BODY, response_model=FileObject, responses=responses(400, 409, 413, 415, 507)
)
async def upload_file(
    request: Request,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
    idem: str | None = Header(None, alias="Idempotency-Key", max_length=300),
):
    """Upload a dataset (JSONL, or a zip holding one and its images) or a zip of images. An
    Idempotency-Key sent again with the same file answers as the first time."""
    received = await receive(request, store, get_settings().max_upload_bytes)
    assert received.upload is not None  # receive() answers 400 when the form has no file part
    purpose = received.fields.get("purpose", "")
    if purpose not in PURPOSES:
        received.upload.abort()
        raise Invalid(
            f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}", param="purpose", code="invalid_purpose"
        )
    return await run_in_threadpool(
        _store_file, session, store, owner, received.upload, received.filename, purpose, idem
    )


@router.get("/v1/files", response_model=ListOf[FileObject], responses=responses(400, 404))
def list_files(
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    purpose: Literal["fine-tune"] | None = Query(None, description="only files of this purpose"),
    after: str | None = Query(None, max_length=64, description="the last file id of the previous page"),
    limit: int = Query(100, ge=1, le=100, description="page size"),
    order: Literal["asc", "desc"] = Query("desc", description="by creation time: desc (newest first) or asc"),
):
    stmt = select(File).where(File.owner == owner, File.deleted_at.is_(None))
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    rows, more = services.paginate(session, stmt, File, after, limit, newest_first=order == "desc")
    return page([file_public(f) for f in rows], more)


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=responses(404))
def retrieve_file(file_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return file_public(services.get_file(session, owner, file_id))


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=responses(404))
def delete_file(
    file_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    services.delete_file(session, store, owner, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/v1/files/{file_id}/report", response_model=DatasetReport, responses=responses(400, 404))
def file_report(
    file_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
    model: str = Query("kiln-tiny", json_schema_extra={"enum": list(CARDS)}, description="the base model"),
    images_file: str | None = Query(None, max_length=64, description="a zip of the images the dataset names"),
    max_seq_len: int | None = Query(None, ge=16, le=1 << 20, description="the job's bound on example length"),
    n_epochs: int = Query(3, ge=1, le=1000, description="epochs, for the training tokens and time"),
):
    """The validation report of a dataset for a base model, before any job: problems by line and
    field, token counts and their histogram, and the training tokens and time to expect (from
    finished jobs on the model: api/estimate.py)."""
    services.check_model(model)
    f = services.get_file(session, owner, file_id)
    if f.kind == "zip" and not f.stats.get("examples"):
        raise Invalid(f"{file_id} is an archive of images, not a dataset", param="file_id")
    images = services.get_file(session, owner, images_file) if images_file else None
    length = catalog.length_bound(model, max_seq_len, "max_seq_len")
    report = services.dataset_report(store, get_settings(), f, images, model, length)
    return services.report_public(session, report, f, model, length, n_epochs)


@router.get(
    "/v1/files/{file_id}/content",
    response_class=FileResponse,
    responses={200: {"content": {"application/jsonl": {}, "application/zip": {}}}, **responses(404)},
)
def file_content(
    file_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    f = services.get_file(session, owner, file_id)
    media = "application/zip" if f.kind == "zip" else "application/jsonl"
    return FileResponse(store.object_path(f.sha256), media_type=media, filename=f.filename)
