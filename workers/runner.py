"""Run one job: claim its lease, build the engine spec, train, record the outcome (the statuses and
their transitions: api.lifecycle).

Safe to run twice for the same job id: the lease lets one worker at a time train it, and a
finished job is left alone. A job whose worker died is resumed from its last checkpoint.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path

from sqlalchemy import select

import engine
from api import lifecycle, logs
from api.db import session_scope
from api.deps import get_store
from api.models import Checkpoint, File, Job
from api.settings import get_settings
from kiln.dataset import DatasetError
from kiln.spec import JobSpec
from workers import metrics
from workers.reporting import DBReporter
from workers.tracking import Tracked

log = logging.getLogger("kiln.worker")


def claim(job_id: str, token: str) -> Job | None:
    with session_scope() as s:
        return lifecycle.claim(s, job_id, token, get_settings().lease_seconds)


def build_spec(job: Job) -> JobSpec:
    """The engine's spec: the job's resolved settings (kiln.spec, validated again here), its
    files as local paths, and its last checkpoint to resume from."""
    store = get_store()
    with session_scope() as s:

        def path(file_id: str | None) -> str | None:
            if file_id is None:
                return None
            f = s.scalar(select(File).where(File.id == file_id))
            assert f is not None  # the job's files were checked when it was created
            return str(store.object_path(f.sha256))

        last = s.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step.desc()).limit(1))
        hp = dict(job.hyperparameters)
        if job.validation_file:
            hp["validation_split"] = 0.0
        start = job.requested.get("from", {})  # a job continued from an earlier fine-tune
        return JobSpec.model_validate(
            {
                **hp,
                "job_id": job.id,
                "model": job.model,
                "training_file": path(job.training_file),
                "validation_file": path(job.validation_file),
                "images_file": path(job.images_file),
                "seed": job.seed,
                "lora": job.lora,
                "method": job.requested.get("method", "supervised"),
                "resume_from": last.store_key if last else start.get("checkpoint"),
                "init_adapter": start.get("adapter"),
            }
        )


def worker_kind() -> str:
    """What the job ran on, for the time estimates: the accelerator's name, else "cpu"."""
    from engine import device

    return device.name(device.resolve())


class Heartbeat(threading.Thread):
    """Extends the lease while the job trains; marks the reporter when the lease is lost."""

    def __init__(self, reporter: DBReporter):
        super().__init__(daemon=True, name=f"heartbeat-{reporter.job_id}")
        self.reporter, self.done = reporter, threading.Event()

    def run(self) -> None:
        settings = get_settings()
        while not self.done.wait(settings.heartbeat_seconds):
            try:
                if not self.reporter.heartbeat(settings.lease_seconds):
                    self.reporter.lease_lost = True
                    return
            except Exception:  # a dropped database connection: try again next beat
                log.warning("heartbeat failed for %s", self.reporter.job_id, exc_info=True)


def run_job(job_id: str) -> str:
    with logs.context(job_id=job_id):
        outcome = _run_job(job_id)
        log.info("job %s", outcome, extra={"outcome": outcome})
    metrics.FINISHED.labels(outcome).inc()
    return outcome


def _run_job(job_id: str) -> str:
    token = secrets.token_hex(8)
    job = claim(job_id, token)
    if job is None:
        log.info("job %s not claimed (finished, paused, cancelled or held by another worker)", job_id)
        return "skipped"
    reporter = DBReporter(job_id, token)
    beat = Heartbeat(reporter)
    beat.start()
    metrics.RUNNING.inc()
    log.info("job started (model %s, owner %s)", job.model, job.owner, extra={"owner_id": job.owner})
    t0 = time.monotonic()

    def measured() -> dict:
        return {"worker_kind": worker_kind(), "run_seconds": (job.run_seconds or 0.0) + time.monotonic() - t0}

    tracked: Tracked | None = None

    def track(status: str, adapter: Path | None = None) -> None:
        if tracked is not None:
            tracked.finish(status, adapter)

    try:
        spec = build_spec(job)
        if job.requested.get("integrations"):
            params = {"model": job.model, **job.hyperparameters, **{f"lora.{k}": v for k, v in job.lora.items()}}
            tracked = Tracked(reporter, job.requested["integrations"], job.id, get_settings(), params)
        result = engine.train(spec, get_store(), tracked or reporter)
    except DatasetError as e:
        track("failed")
        reporter.finish(
            "failed",
            f"Dataset error: {e}",
            level="error",
            error={"code": "invalid_training_file", "message": str(e), "param": "training_file"},
        )
        return "failed"
    except Exception as e:
        log.exception("job %s failed", job_id)
        track("failed")
        reporter.finish(
            "failed",
            f"Training failed: {type(e).__name__}: {e}",
            level="error",
            error={"code": "training_error", "message": f"{type(e).__name__}: {e}", "param": None},
        )
        return "failed"
    finally:
        beat.done.set()
        metrics.RUNNING.dec()
    if result.status == "succeeded":
        suffix = job.suffix or ""
        track("succeeded", get_store().path(result.adapter_key) if result.adapter_key else None)
        reporter.finish(
            "succeeded",
            "The job has successfully completed",
            adapter_key=result.adapter_key,
            trained_tokens=result.trained_tokens,
            fine_tuned_model=f"ft:{job.model}:{job.owner}:{suffix}:{job.id.removeprefix('ftjob-')[:12]}",
            **measured(),
        )
        return "succeeded"
    if result.stop_reason == "cancel":
        track("cancelled")
        reporter.finish("cancelled", "Job cancelled", trained_tokens=result.trained_tokens)
        return "cancelled"
    if result.stop_reason == "pause":
        step = result.final_metrics.get("step", 0)
        track("paused")
        reporter.finish("paused", f"Job paused at step {step}; resume continues from there", **measured())
        return "paused"
    log.warning("job %s: lease lost, another worker owns it now", job_id)
    return "lost"
