"""Request-scoped dependencies: the database session and the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import lru_cache

from sqlalchemy.orm import Session

from api.db import get_sessionmaker
from api.ratelimit import RateLimiter
from api.settings import get_settings
from kiln.store import LocalStore


async def get_session() -> AsyncIterator[Session]:
    """A session per request, closed on the event loop: closing needs no worker thread, so a
    request that holds a pooled connection never waits for a thread to give it back."""
    session = get_sessionmaker()()
    try:
        yield session
    finally:
        session.close()


@lru_cache
def get_store() -> LocalStore:
    return LocalStore(get_settings().resolved_store_dir())


@lru_cache
def get_rate_limiter() -> RateLimiter:
    settings = get_settings()
    return RateLimiter(settings.rate_limit_per_minute, settings.rate_limit_burst)
