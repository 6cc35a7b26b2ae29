"""Run one job: claim its lease, build the engine spec, train, record the outcome.

Safe to run twice for the same job id: the lease lets one worker at a time train it, and a
finished job is left alone. A job whose worker died is resumed from its last checkpoint.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from sqlalchemy import or_, select, update

import engine
from api.db import session_scope
from api.deps import get_store
from api.models import Checkpoint, File, Job, JobEvent, now
from api.settings import get_settings
from engine.spec import JobSpec, LoraSpec, MemorySpec, ParallelSpec
from kiln.dataset import DatasetError
from workers.reporting import DBReporter

log = logging.getLogger("kiln.worker")


def claim(job_id: str, token: str) -> Job | None:
    """Take the job's lease if nobody holds a live one. Returns the job, now running."""
    settings, t = get_settings(), time.time()
    with session_scope() as s:
        res = s.execute(
            update(Job)
            .where(
                Job.id == job_id,
                Job.status.in_(("queued", "running")),
                or_(Job.lease_expires.is_(None), Job.lease_expires < t),
            )
            .values(lease_token=token, lease_expires=t + settings.lease_seconds, attempt=Job.attempt + 1)
        )
        if res.rowcount != 1:  # type: ignore[attr-defined]  # an UPDATE's Result is a CursorResult
            return None
        job = s.scalar(select(Job).where(Job.id == job_id))
        assert job is not None  # its lease was just taken
        if job.cancel_requested:
            job.status, job.finished_at, job.lease_token = "cancelled", now(), None
            s.add(JobEvent(job_id=job_id, message="Job cancelled"))
            return None
        first = job.status == "queued"
        job.status = "running"
        job.started_at = job.started_at or now()
        s.add(
            JobEvent(
                job_id=job_id,
                message="Fine-tuning job started" if first else f"Worker restarted the job (attempt {job.attempt})",
            )
        )
        return job


def build_spec(job: Job) -> JobSpec:
    store = get_store()
    with session_scope() as s:

        def path(file_id: str) -> str:
            f = s.scalar(select(File).where(File.id == file_id))
            assert f is not None  # the job's files were checked when it was created
            return str(store.object_path(f.sha256))

        last = s.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step.desc()).limit(1))
        hp = job.hyperparameters
        return JobSpec(
            job_id=job.id,
            model=job.model,
            training_file=path(job.training_file),
            validation_file=path(job.validation_file) if job.validation_file is not None else None,
            images_file=path(job.images_file) if job.images_file is not None else None,
            n_epochs=hp.get("n_epochs", "auto"),
            batch_size=hp.get("batch_size", "auto"),
            learning_rate_multiplier=hp.get("learning_rate_multiplier", "auto"),
            checkpoint_interval=hp.get("checkpoint_interval"),
            max_steps=hp.get("max_steps"),
            max_seq_len=hp.get("max_seq_len"),
            warmup_ratio=hp.get("warmup_ratio", 0.05),
            seed=job.seed,
            gradient_accumulation_steps=hp.get("gradient_accumulation_steps", 1),
            packing=hp.get("packing", True),
            group_by_length=hp.get("group_by_length", False),
            validation_split=0.0 if job.validation_file else hp.get("validation_split", 0.0),
            lora=LoraSpec(**job.lora),
            memory=MemorySpec(**hp.get("memory", {})),
            parallel=ParallelSpec(**hp.get("parallel", {})),
            resume_from=last.store_key if last else None,
        )


class Heartbeat(threading.Thread):
    """Extends the lease while the job trains; marks the reporter when the lease is lost."""

    def __init__(self, reporter: DBReporter):
        super().__init__(daemon=True, name=f"heartbeat-{reporter.job_id}")
        self.reporter, self.done = reporter, threading.Event()

    def run(self) -> None:
        settings = get_settings()
        while not self.done.wait(settings.heartbeat_seconds):
            try:
                if not self.reporter.fenced_update(lease_expires=time.time() + settings.lease_seconds):
                    self.reporter.lease_lost = True
                    return
            except Exception:  # a dropped database connection: try again next beat
                log.warning("heartbeat failed for %s", self.reporter.job_id, exc_info=True)


def finish(reporter: DBReporter, status: str, message: str, level: str = "info", **values) -> None:
    done = reporter.fenced_update(status=status, finished_at=now(), lease_token=None, lease_expires=None, **values)
    if done:
        reporter.message(message, level=level)


def run_job(job_id: str) -> str:
    token = secrets.token_hex(8)
    job = claim(job_id, token)
    if job is None:
        log.info("job %s not claimed (finished, cancelled or held by another worker)", job_id)
        return "skipped"
    reporter = DBReporter(job_id, token)
    beat = Heartbeat(reporter)
    beat.start()
    try:
        spec = build_spec(job)
        result = engine.train(spec, get_store(), reporter)
    except DatasetError as e:
        finish(
            reporter,
            "failed",
            f"Dataset error: {e}",
            level="error",
            error={"code": "invalid_training_file", "message": str(e), "param": "training_file"},
        )
        return "failed"
    except Exception as e:
        log.exception("job %s failed", job_id)
        finish(
            reporter,
            "failed",
            f"Training failed: {type(e).__name__}: {e}",
            level="error",
            error={"code": "training_error", "message": f"{type(e).__name__}: {e}", "param": None},
        )
        return "failed"
    finally:
        beat.done.set()
    if result.status == "succeeded":
        suffix = job.suffix or ""
        finish(
            reporter,
            "succeeded",
            "The job has successfully completed",
            adapter_key=result.adapter_key,
            trained_tokens=result.trained_tokens,
            fine_tuned_model=f"ft:{job.model}:{job.owner}:{suffix}:{job.id.removeprefix('ftjob-')[:12]}",
        )
        return "succeeded"
    if result.stop_reason == "cancel":
        finish(reporter, "cancelled", "Job cancelled", trained_tokens=result.trained_tokens)
        return "cancelled"
    log.warning("job %s: lease lost, another worker owns it now", job_id)
    return "lost"
