"""Bearer API keys. Only the SHA-256 of a key is stored: keys are 192-bit random secrets, so a
fast hash is enough and lookups stay one indexed query."""

from __future__ import annotations

import hashlib
import secrets

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import logs
from api.deps import get_rate_limiter, get_session
from api.errors import ApiError
from api.models import ApiKey, now

KEY_PREFIX = "sk-kiln-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(session: Session, owner: str, name: str = "") -> tuple[ApiKey, str]:
    if not owner:
        raise ValueError("owner must not be empty")
    secret = KEY_PREFIX + secrets.token_urlsafe(24)
    key = ApiKey(owner=owner, name=name, key_hash=hash_key(secret), prefix=secret[:12])
    session.add(key)
    session.flush()
    return key, secret


def revoke_key(session: Session, key_id: str, owner: str | None = None) -> ApiKey | None:
    """Revoke a key (only the owner's, when ``owner`` is given). None if there is no such key."""
    stmt = select(ApiKey).where(ApiKey.id == key_id)
    if owner is not None:
        stmt = stmt.where(ApiKey.owner == owner)
    key = session.scalar(stmt)
    if key is not None:
        key.revoked_at = key.revoked_at or now()
    return key


def current_owner(request: Request, session: Session = Depends(get_session)) -> str:
    """The owner of the request's API key; also spends one token of the key's rate limit."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    found = session.execute(
        select(ApiKey.id, ApiKey.owner, ApiKey.revoked_at).where(ApiKey.key_hash == hash_key(token.strip()))
    ).first()
    session.rollback()  # end the read: the connection goes back to the pool before the route's thread hop
    if found is None or found.revoked_at is not None:
        raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    logs.bind(owner_id=found.owner, key_id=found.id)
    get_rate_limiter().check(found.id)
    return found.owner
