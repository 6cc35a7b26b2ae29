"""Celery workers: claim a job, hand it to the engine, write what it reports to the database."""
