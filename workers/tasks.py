"""Celery tasks: thin wrappers that take ids only and call plain functions."""

from __future__ import annotations

from api import logs, webhooks
from api.exports import EXPORT_TASK
from api.queue import RUN_TASK, WEBHOOK_TASK
from workers.celery_app import app


@app.task(name=RUN_TASK)
def run_finetune(job_id: str) -> str:
    from workers.runner import run_job

    return run_job(job_id)


@app.task(name=WEBHOOK_TASK)
def deliver_webhook(delivery_id: str) -> str:
    """On the webhook queue (api/webhooks.py), which its own worker consumes: never behind training."""
    return webhooks.deliver(delivery_id)


@app.task(name=EXPORT_TASK)
def export_model(job_id: str) -> str:
    """On the training queue: the merge loads the whole model, as training does (api/exports.py)."""
    from workers.exports import run_export

    with logs.context(job_id=job_id):
        return run_export(job_id)
