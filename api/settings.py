"""Settings from the environment (prefix ``KILN_``), read once and cached.

The defaults are the embedded ones: SQLite, Celery over SQLite, a local folder as object store,
all under ``KILN_HOME`` (``./kiln-data``). Production sets ``KILN_DATABASE_URL`` to PostgreSQL and
``KILN_BROKER_URL`` to Redis.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    home: Path = Path("kiln-data")
    database_url: str = ""  # default: sqlite under home
    broker_url: str = ""  # default: Celery's SQLAlchemy transport on sqlite under home
    queue: str = "kiln"
    store_dir: Path | None = None  # default: home / "store"
    store_url: str = ""  # file:///path or s3://bucket/prefix (kiln.store.open_store); empty: store_dir
    store_cache_dir: Path | None = None  # an S3 store's local copies; default: home / "store-cache"

    max_upload_bytes: int = 1 << 30  # 1 GiB per uploaded file
    max_line_bytes: int = 8 << 20  # one JSONL line (inline data-URL images make lines long)
    max_archive_members: int = 200_000
    max_archive_unpacked_bytes: int = 20 << 30  # zip-bomb guard: declared size of all members
    max_image_pixels: int = 50_000_000  # decompression-bomb guard; the ViT resizes anyway

    rate_limit_per_minute: float = 1200.0  # per API key; 0 turns it off
    rate_limit_burst: int = 200  # at most this many in any burst/per_minute minutes (200 in 10 s)
    # Where the counts live: "memory://" (each API process its own), "redis://..." (one budget for
    # every API process). Empty: the broker's Redis when the broker is Redis, else memory.
    rate_limit_storage_url: str = ""

    # Observability (api/logs.py, api/observe.py, workers/metrics.py)
    log_format: str = "json"  # json: one object a line; text: for a person at a terminal
    metrics_token: str = ""  # when set, the API's /metrics asks for "Authorization: Bearer <token>"
    worker_metrics_port: int = 0  # a training worker's /metrics port (0: none); one per worker process

    lease_seconds: float = 60.0  # a running job whose heartbeat is older than this is re-queued
    heartbeat_seconds: float = 5.0
    reaper_seconds: float = 10.0  # how often a worker looks for jobs to re-queue
    requeue_queued_after_seconds: float = 120.0  # a queued job nobody took is sent again

    # Webhooks (api/webhooks.py): sent on their own queue, which a worker of their own consumes
    # (`celery -A workers.celery_app worker --pool=threads -Q <webhook queue>`), never a training one.
    webhook_queue: str = ""  # default: "<queue>-webhooks"
    webhook_timeout_seconds: float = 15.0  # an attempt's connect and read limits (Standard Webhooks: 15-30 s)
    webhook_max_attempts: int = 18  # with the backoff below: retries for about 35 hours
    webhook_backoff_seconds: float = 5.0  # the first retry's delay, doubled after each failure ...
    webhook_backoff_max_seconds: float = 6 * 3600.0  # ... up to this (kept under the broker's visibility timeout)
    webhook_resend_after_seconds: float = 60.0  # the reaper re-sends a due delivery no sender took this long

    # experiment tracking (a job's integrations): the operator's, never a request's
    mlflow_tracking_uri: str = ""  # e.g. http://mlflow:5000; empty: jobs cannot ask for mlflow
    wandb_mode: str = "online"  # wandb's mode: online (WANDB_API_KEY), offline (runs written under home/wandb)

    # The inference server (workers/inference.py, `python -m workers.inference`): its own process,
    # listening on this URL's host and port; the API sends it chat requests.
    inference_url: str = "http://127.0.0.1:8766"
    inference_timeout_seconds: float = 300.0  # the longest wait for its next byte (a base model loads on first use)
    inference_device: str = ""  # the server's torch device (cuda, npu, cpu); empty: the best one there is
    inference_max_batch: int = 8  # sequences one base model decodes side by side
    # adapters one base model holds at once; a new one unloads the least recently used idle ones
    inference_max_adapters: int = 32

    sse_poll_seconds: float = 0.5
    sse_keepalive_seconds: float = 15.0

    base_models: list[str] = Field(default_factory=lambda: ["kiln-tiny"])

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'kiln.sqlite').resolve()}"

    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{(self.home / 'broker.sqlite').resolve()}"

    def resolved_rate_limit_storage_url(self) -> str:
        if self.rate_limit_storage_url:
            return self.rate_limit_storage_url
        broker = self.resolved_broker_url()
        return broker if broker.startswith(("redis://", "rediss://")) else "memory://"

    def resolved_webhook_queue(self) -> str:
        return self.webhook_queue or f"{self.queue}-webhooks"

    def resolved_store_cache_dir(self) -> Path:
        return (self.store_cache_dir or self.home / "store-cache").resolve()

    def resolved_store_dir(self) -> Path:
        return (self.store_dir or self.home / "store").resolve()


@lru_cache
def get_settings() -> Settings:
    settings = Settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    return settings
