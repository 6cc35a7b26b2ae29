"""/v1/keys: an owner lists, creates and revokes their own API keys. The secret of a new key is
returned once; only its hash is stored."""

from __future__ import annotations

from fastapi import Depends
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import create_key, current_owner, revoke_key
from api.deps import Router, get_session
from api.errors import not_found, responses
from api.models import ApiKey
from kiln.spec import Text
from kiln.types import ApiKeyInfo, ListOf

router = Router(prefix="/v1/keys", tags=["keys"])


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text = Field("", max_length=200)


def key_public(k: ApiKey) -> dict:
    return {
        "id": k.id,
        "object": "api_key",
        "name": k.name,
        "prefix": k.prefix,
        "created_at": k.created_at,
        "revoked_at": k.revoked_at,
    }


@router.get("", response_model=ListOf[ApiKeyInfo])
def list_keys(owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    keys = session.scalars(select(ApiKey).where(ApiKey.owner == owner).order_by(ApiKey.pk))
    return {"object": "list", "data": [key_public(k) for k in keys], "has_more": False}


@router.post("", response_model=ApiKeyInfo, responses=responses(400))
def new_key(req: KeyCreate, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    key, secret = create_key(session, owner, req.name)
    session.commit()
    return {**key_public(key), "secret": secret}


@router.delete("/{key_id}", response_model=ApiKeyInfo, responses=responses(404))
def revoke(key_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    key = revoke_key(session, key_id, owner)
    if key is None:
        raise not_found("API key", key_id)
    session.commit()
    return key_public(key)
