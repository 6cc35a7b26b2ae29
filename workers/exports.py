"""Make a fine-tuned model's merged export (api/exports.py holds its states and store keys): the
base with the job's adapter folded in (engine.tools.export), zipped into the store. Safe to run
twice: a finished export, or one another worker is making, is left alone."""

from __future__ import annotations

import logging
import secrets
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

from sqlalchemy import select

from api import exports
from api.db import session_scope
from api.deps import get_store
from api.models import Job
from api.settings import get_settings
from engine.model.registry import ensure_builtin
from engine.tools.export import export

log = logging.getLogger("kiln.worker")


def zip_folder(folder: Path, dest: Path) -> None:
    """The folder's files at the archive's top level, stored (safetensors barely compress)."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(folder.iterdir()):
            zf.write(p, p.name)


def run_export(job_id: str) -> str:
    with session_scope() as s:
        job = s.scalar(select(Job).where(Job.id == job_id))
        if job is None or job.status != "succeeded" or not job.adapter_key:
            log.warning("export of %s skipped: no succeeded job with an adapter", job_id)
            return "skipped"
        model, adapter_key = job.model, job.adapter_key
    store, settings, token = get_store(), get_settings(), secrets.token_hex(8)
    if not exports.claim(store, job_id, token):
        log.info("export of %s not claimed (made already, or another worker is making it)", job_id)
        return "skipped"
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(settings.heartbeat_seconds):
            try:
                if not exports.beat(store, job_id, token):
                    return
            except OSError:  # a store hiccup: the next beat tries again
                log.warning("export heartbeat failed for %s", job_id, exc_info=True)

    beat = threading.Thread(target=heartbeat, daemon=True, name=f"export-heartbeat-{job_id}")
    beat.start()
    result: dict[str, Any]
    try:
        base = store.model_dir(model)
        ensure_builtin(model, base)
        with tempfile.TemporaryDirectory(dir=store.tmp, prefix="export-") as tmp:
            info = export(base, store.path(adapter_key), Path(tmp) / "merged")
            with store.publish_file(exports.archive_key(job_id)) as path:
                zip_folder(Path(tmp) / "merged", path)
        size = store.path(exports.archive_key(job_id)).stat().st_size
        result = {"status": "succeeded", "bytes": size, "model_type": info.model_type, "dtypes": list(info.dtypes)}
    except Exception as e:
        log.exception("export of %s failed", job_id)
        error = {"code": "export_error", "message": f"{type(e).__name__}: {e}", "param": None}
        result = {"status": "failed", "error": error}
    finally:  # no heartbeat may land after the outcome
        stop.set()
        beat.join()
    exports.finish(store, job_id, token, **result)
    return str(result["status"])
