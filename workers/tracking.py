"""Experiment tracking, a job's ``integrations`` (kiln.spec): Weights & Biases and MLflow runs
fed by the reporter the engine calls. A run per job, found again when the job resumes on another
worker (wandb: the job's id as the run's; MLflow: the run tagged with it). The tracking servers
and modes are the operator's settings, never a request's.

A tracker that fails says so in a job event (warn) and stops; it never fails the job.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from api.settings import Settings
from engine.spec import Reporter

log = logging.getLogger("kiln.tracking")


class Wandb:
    name = "Weights & Biases"

    def __init__(self, cfg: dict, job_id: str, settings: Settings):
        import wandb

        self.wandb = wandb
        folder = settings.home.resolve() / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg["project"],
            entity=cfg.get("entity"),
            name=cfg.get("name") or job_id,
            tags=cfg.get("tags") or None,
            id=re.sub(r"[^a-zA-Z0-9_-]", "-", job_id),
            resume="allow",
            dir=str(folder),
            mode=settings.wandb_mode,  # type: ignore[arg-type]
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def params(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def artifact(self, path: Path, name: str) -> None:
        art = self.wandb.Artifact(name, type="model")
        art.add_file(str(path))
        self.run.log_artifact(art)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "succeeded" else 1)


class Mlflow:
    name = "MLflow"

    def __init__(self, cfg: dict, job_id: str, settings: Settings):
        # mlflow's own defaults retry a dead server for minutes on every call; a step should not wait that long
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient

        self.client = client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        exp = client.get_experiment_by_name(cfg.get("experiment") or "kiln")
        exp_id = exp.experiment_id if exp else client.create_experiment(cfg.get("experiment") or "kiln")
        found = client.search_runs([exp_id], filter_string=f"tags.`kiln.job_id` = '{job_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {**cfg.get("tags", {}), "kiln.job_id": job_id}
            self.run_id = client.create_run(exp_id, run_name=cfg.get("run_name") or job_id, tags=tags).info.run_id

    def params(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params  # a resumed run logs its parameters once
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in values.items() if k not in have])

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        t = int(time.time() * 1000)
        batch = [Metric(k, float(v), t, step) for k, v in values.items() if isinstance(v, (int, float))]
        self.client.log_batch(self.run_id, metrics=batch)

    def artifact(self, path: Path, name: str) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=name)

    def finish(self, status: str) -> None:
        self.client.set_terminated(
            self.run_id, {"succeeded": "FINISHED", "cancelled": "KILLED", "paused": "SCHEDULED"}.get(status, "FAILED")
        )


KINDS = {"wandb": Wandb, "mlflow": Mlflow}


class Tracked:
    """The engine's reporter with the job's trackers fed from it: every call goes on to the
    job's own reporter; a tracker's error becomes a warning event and ends that tracker."""

    def __init__(
        self, reporter: Reporter, integrations: list[dict], job_id: str, settings: Settings, params: dict[str, Any]
    ):
        self.reporter = reporter
        self.trackers: list[Wandb | Mlflow] = []
        for cfg in integrations:
            kind = KINDS[cfg["type"]]
            start = lambda kind=kind, cfg=cfg: self.trackers.append(kind(cfg[cfg["type"]], job_id, settings))
            self._try(kind, "start", start)
        self._each("parameters", "params", params)

    def _try(self, tracker: Any, what: str, call) -> None:
        try:
            call()
        except Exception as e:  # a tracking failure is an event, never a job failure
            log.warning("tracking %s failed", what, exc_info=True)
            self.reporter.message(
                f"Tracking to {tracker.name} failed ({what}: {type(e).__name__}: {e}); the job goes on without it",
                level="warn",
            )
            if tracker in self.trackers:
                self.trackers.remove(tracker)

    def _each(self, what: str, method: str, *args) -> None:
        for t in list(self.trackers):
            self._try(t, what, lambda t=t: getattr(t, method)(*args))

    # the engine's Reporter
    def message(self, text: str, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self.reporter.message(text, level, data)

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        self.reporter.metrics(step, values)
        self._each(f"step {step}", "metrics", step, values)

    def checkpoint(self, step: int, key: str, metrics: dict[str, Any]) -> None:
        self.reporter.checkpoint(step, key, metrics)

    def resolved(self, hyperparameters: dict[str, Any]) -> None:
        self.reporter.resolved(hyperparameters)
        self._each("parameters", "params", hyperparameters)

    def should_stop(self) -> str | None:
        return self.reporter.should_stop()

    # the worker's
    def finish(self, status: str, adapter: Path | None = None) -> None:
        if adapter is not None:
            self._each("the adapter", "artifact", adapter, "adapter")
        self._each("finishing", "finish", status)
