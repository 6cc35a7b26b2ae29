"""/v1/models: the base models and the caller's fine-tuned models."""

from __future__ import annotations

from fastapi import Depends
from sqlalchemy.orm import Session

from api import services
from api.auth import current_owner
from api.deps import Router, get_session
from api.errors import not_found, responses
from kiln.types import ListOf, Model

router = Router(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListOf[Model])
def list_models(owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return {"object": "list", "data": services.models_for(session, owner)}


@router.get("/{model_id:path}", response_model=Model, responses=responses(404))
def retrieve_model(model_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    for m in services.models_for(session, owner):
        if m["id"] == model_id:
            return m
    raise not_found("model", model_id)
