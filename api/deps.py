"""Request-scoped dependencies (the database session, the store) and the router every route
module uses."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from fastapi import APIRouter
from sqlalchemy.orm import Session

from api.db import get_sessionmaker
from api.ratelimit import RateLimiter
from api.settings import get_settings
from kiln.store import ObjectStore, open_store


async def get_session() -> AsyncIterator[Session]:
    """A session per request, closed on the event loop: closing needs no worker thread, so a
    request that holds a pooled connection never waits for a thread to give it back."""
    session = get_sessionmaker()()
    try:
        yield session
    finally:
        session.close()


@lru_cache
def get_store() -> ObjectStore:
    s = get_settings()
    return open_store(s.store_url or s.resolved_store_dir(), s.resolved_store_cache_dir())


@lru_cache
def get_rate_limiter() -> RateLimiter:
    settings = get_settings()
    return RateLimiter(
        settings.rate_limit_per_minute, settings.rate_limit_burst, settings.resolved_rate_limit_storage_url()
    )


def _releasing(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)  # FastAPI reads the signature (and its names) through __wrapped__
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            session = kwargs.get("session")
            if isinstance(session, Session):
                session.close()

    return run


class Router(APIRouter):
    """A sync route gives its database connection back the moment it returns. FastAPI validates
    a sync route's response in the threadpool: a session held across that second thread hop ran
    the pool dry under load, requests holding connections waiting for threads that waited for
    connections (tests/integration/test_load.py)."""

    def add_api_route(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _releasing(endpoint)
        super().add_api_route(path, endpoint, **kwargs)
