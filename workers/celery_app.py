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

from celery.signals import worker_ready, worker_shutdown

from api.queue import make_celery
from api.settings import get_settings

app = make_celery(get_settings())
app.conf.include = ["workers.tasks"]
_reaper = None


@worker_ready.connect
def _start_reaper(**_):
    global _reaper
    from workers.reaper import Reaper

    _reaper = Reaper()
    _reaper.start()


@worker_shutdown.connect
def _stop_reaper(**_):
    if _reaper:
        _reaper.stopped.set()
