"""The Celery configuration, shared by the API (which only sends by task name) and the workers.

Long jobs and Redis: an unacknowledged task comes back after ``visibility_timeout``, so it is
raised far above any job; a worker that dies is noticed through the job's lease instead (see
workers.reaper). ``acks_late`` keeps the message until the job ends; prefetch 1 keeps a busy
worker from holding messages another worker could run.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Celery

from api.settings import Settings, get_settings

RUN_TASK = "kiln.run_finetune"
WEBHOOK_TASK = "kiln.deliver_webhook"  # on its own queue (Settings.resolved_webhook_queue): see api/webhooks.py
log = logging.getLogger("kiln.queue")


def make_celery(settings: Settings) -> Celery:
    broker = settings.resolved_broker_url()
    # Kombu's SQLAlchemy transport hands its options to create_engine: Redis options only for Redis.
    options = {"visibility_timeout": 7 * 24 * 3600} if broker.startswith(("redis", "rediss")) else {}
    app = Celery("kiln", broker=broker)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=settings.queue,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options=options,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
        worker_hijack_root_logger=False,
    )
    return app


@lru_cache
def client() -> Celery:
    return make_celery(get_settings())


def enqueue(job_id: str) -> bool:
    """Send the job id (the only payload). False if the broker could not be reached: the
    reaper re-sends queued jobs that no worker took."""
    try:
        client().send_task(RUN_TASK, args=[job_id], queue=get_settings().queue)
        return True
    except Exception:
        log.exception("could not enqueue %s", job_id)
        return False


def send_delivery(delivery_id: str, countdown: float | None = None) -> bool:
    """Send a webhook delivery's id to the webhook queue, to run now or after ``countdown`` seconds
    (a retry). False if the broker could not be reached: the reaper re-sends due deliveries that no
    sender took."""
    try:
        client().send_task(
            WEBHOOK_TASK, args=[delivery_id], queue=get_settings().resolved_webhook_queue(), countdown=countdown
        )
        return True
    except Exception:
        log.exception("could not send webhook delivery %s", delivery_id)
        return False
