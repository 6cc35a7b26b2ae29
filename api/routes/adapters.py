"""Adapter downloads: the final adapter, or any checkpoint's, as a zip in the PEFT layout."""

from __future__ import annotations

import os
import tempfile
import zipfile
from typing import Any

from fastapi import Depends
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session
from starlette.background import BackgroundTask

from api import services
from api.auth import current_owner
from api.deps import Router, get_session, get_store
from api.errors import Conflict, responses
from kiln.store import ObjectStore

router = Router(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
ZIP: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/zip": {}}, "description": "the adapter in the PEFT layout, zipped"}
}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")


def _name(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model)


@router.get("/{job_id}/adapter", response_class=FileResponse, responses={**ZIP, **responses(404, 409)})
def download_adapter(
    job_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    job = services.get_job(session, owner, job_id)
    if job.status != "succeeded" or not job.adapter_key:
        raise Conflict(
            f"Job {job_id} is {job.status}: the adapter is ready once it has succeeded "
            "(checkpoint adapters are under /checkpoints/{id}/adapter)",
            "adapter_not_ready",
        )
    return FileResponse(
        store.path(job.adapter_key),
        media_type="application/zip",
        filename=f"{_name(job.fine_tuned_model or job.id)}.zip",
    )


@router.get("/{job_id}/checkpoints/{ckpt_id}/adapter", response_class=FileResponse, responses={**ZIP, **responses(404)})
def download_checkpoint_adapter(
    job_id: str,
    ckpt_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    job = services.get_job(session, owner, job_id)
    ckpt = services.get_checkpoint(session, job, ckpt_id)
    folder = store.path(ckpt.store_key)
    fd, tmp = tempfile.mkstemp(dir=store.tmp, prefix="download-", suffix=".zip")
    os.close(fd)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in ADAPTER_FILES:
            if (folder / name).exists():
                zf.write(folder / name, name)
    return FileResponse(
        tmp,
        media_type="application/zip",
        filename=f"{job.id}-step-{ckpt.step}.zip",
        background=BackgroundTask(os.unlink, tmp),
    )
