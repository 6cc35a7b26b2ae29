"""/v1/models: the base models and the caller's fine-tuned models, and a fine-tuned model's merged
export (api/exports.py). The export routes come before ``GET /{model_id:path}``, which would
otherwise take their paths for a model's id."""

from __future__ import annotations

from typing import Any

from fastapi import Depends
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session

from api import exports, services
from api.auth import current_owner
from api.deps import Router, get_session, get_store
from api.errors import not_found, responses
from kiln.exports import Export
from kiln.store import ObjectStore
from kiln.types import ListOf, Model

router = Router(prefix="/v1/models", tags=["models"])
ZIP: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/zip": {}},
        "description": "the merged model's folder, zipped: config.json, model.safetensors, the base's tokenizer files",
    }
}


@router.get("", response_model=ListOf[Model])
def list_models(owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return {"object": "list", "data": services.models_for(session, owner)}


@router.post("/{model_id:path}/export", status_code=202, response_model=Export, responses=responses(400, 404))
def start_export(
    model_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    """Merge the fine-tuned model's adapter into its base, on a worker. Idempotent: the export
    already made or under way is the answer; a failed one starts again."""
    return exports.start(session, store, owner, model_id)


@router.get("/{model_id:path}/export", response_model=Export, responses=responses(400, 404))
def retrieve_export(
    model_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    return exports.get(session, store, owner, model_id)


@router.get(
    "/{model_id:path}/export/content", response_class=FileResponse, responses={**ZIP, **responses(400, 404, 409)}
)
def download_export(
    model_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
):
    path = exports.archive(session, store, owner, model_id)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    return FileResponse(path, media_type="application/zip", filename=f"{name}-merged.zip")


@router.get("/{model_id:path}", response_model=Model, responses=responses(404))
def retrieve_model(model_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    for m in services.models_for(session, owner):
        if m["id"] == model_id:
            return m
    raise not_found("model", model_id)
