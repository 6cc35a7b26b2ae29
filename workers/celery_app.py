"""The worker's Celery app: ``celery -A workers.celery_app worker --pool=solo``.

The solo pool runs the job in the worker process itself (no fork after torch is loaded); run
one worker process per device set.
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
