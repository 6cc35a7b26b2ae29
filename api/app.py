"""The FastAPI application factory: ``uvicorn --factory api.app:create_app``."""

from __future__ import annotations

import signal
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from api import errors, logs, observe, openapi
from api.errors import responses
from api.routes import adapters, chat, events, files, jobs, keys, models, webhooks
from api.settings import get_settings


def _end_streams_on_exit() -> None:
    """Chain a hook before the server's own SIGTERM / SIGINT handler (uvicorn's, installed before
    the lifespan starts) that ends every open event stream: a clean shutdown waits for open
    responses, and a stream otherwise lasts as long as its job."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(sig)

        def hook(signum, frame, before=before):
            events.SHUTTING_DOWN.set()
            if callable(before):
                before(signum, frame)

        signal.signal(sig, hook)


@asynccontextmanager
async def lifespan(_app: FastAPI):
    _end_streams_on_exit()
    yield
    events.SHUTTING_DOWN.set()


def create_app() -> FastAPI:
    settings = get_settings()
    logs.configure(settings.log_format)
    app = FastAPI(
        title="Kiln",
        version="0.1.0",
        description="LoRA fine-tuning for Kimi-family models, OpenAI-compatible.",
        lifespan=lifespan,
    )
    errors.install(app)
    observe.install(app, settings.metrics_token)
    routers = (
        files.router,
        jobs.router,
        events.router,
        adapters.router,
        models.router,
        keys.router,
        webhooks.router,
        chat.router,
    )
    for r in routers:
        app.include_router(r, responses=responses(401, 429))
    openapi.install(app)

    @app.get("/healthz", include_in_schema=False)
    def healthz():
        return {"ok": True}

    @app.get("/", include_in_schema=False)
    def home():
        return RedirectResponse("/ui/")

    # The monitoring page: static files; it signs in with an API key and calls the REST API.
    app.mount("/ui", StaticFiles(directory=Path(__file__).parent / "web", html=True), name="ui")

    return app
