"""The worker's Celery app: ``celery -A workers.celery_app worker --pool=solo``.

The solo pool runs the job in the worker process itself (no fork after torch is loaded); run
one worker process per device set.

Webhook deliveries (api/webhooks.py) go to their own queue (``KILN_WEBHOOK_QUEUE``, default
``<queue>-webhooks``), consumed by a light worker of this same app that never trains:
``celery -A workers.celery_app worker --pool=threads --concurrency=8 -Q kiln-webhooks``. A training
worker never takes them, so no delivery waits behind a job. Every worker, that one included, runs
the reaper, which also re-sends deliveries that were written but never sent or whose sender died.
"""

from __future__ import annotations

from celery.signals import setup_logging, worker_ready, worker_shutdown

from api import logs
from api.queue import make_celery
from api.settings import get_settings

app = make_celery(get_settings())
app.conf.include = ["workers.tasks"]
_reaper = None


@setup_logging.connect
def _logs(**_):
    """Kiln's JSON lines (api/logs.py) instead of Celery's own format."""
    logs.configure(get_settings().log_format)


@worker_ready.connect
def _start_reaper(sender=None, **_):
    global _reaper
    from workers import metrics
    from workers.reaper import Reaper

    _reaper = Reaper()
    _reaper.start()
    pool = type(getattr(sender, "pool", None)).__module__
    if pool == "celery.concurrency.solo":  # training workers; the webhook sender (threads) has no metrics
        metrics.serve(get_settings().worker_metrics_port)


@worker_shutdown.connect
def _stop_reaper(**_):
    if _reaper:
        _reaper.stopped.set()
