"""The FastAPI application factory: ``uvicorn --factory api.app:create_app``."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from api import errors
from api.routes import adapters, events, files, jobs, keys, models


def create_app() -> FastAPI:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = FastAPI(
        title="Kiln", version="0.1.0", description="LoRA fine-tuning for Kimi-family models, OpenAI-compatible."
    )
    errors.install(app)
    for r in (files.router, jobs.router, events.router, adapters.router, models.router, keys.router):
        app.include_router(r)

    @app.get("/healthz", include_in_schema=False)
    def healthz():
        return {"ok": True}

    @app.get("/", include_in_schema=False)
    def home():
        return RedirectResponse("/ui/")

    # The monitoring page: static files; it signs in with an API key and calls the REST API.
    app.mount("/ui", StaticFiles(directory=Path(__file__).parent / "web", html=True), name="ui")

    return app
