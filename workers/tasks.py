"""Celery tasks: thin wrappers that take ids only and call plain functions."""

from __future__ import annotations

from api.queue import RUN_TASK
from workers.celery_app import app


@app.task(name=RUN_TASK)
def run_finetune(job_id: str) -> str:
    from workers.runner import run_job

    return run_job(job_id)
