"""Typed response objects. Unknown fields are kept (``model_extra``) so a newer server's
additions are not lost."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

TERMINAL = ("succeeded", "failed", "cancelled")


class _Obj(BaseModel):
    model_config = ConfigDict(extra="allow")


class FileObject(_Obj):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    stats: dict[str, Any] = {}


class JobError(_Obj):
    code: str | None = None
    message: str | None = None
    param: str | None = None


class Job(_Obj):
    id: str
    status: str
    model: str
    created_at: int
    training_file: str
    validation_file: str | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    trained_tokens: int | None = None
    hyperparameters: dict[str, Any] = {}
    error: JobError | None = None
    suffix: str | None = None
    seed: int | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class JobEvent(_Obj):
    id: str
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class Checkpoint(_Obj):
    id: str
    created_at: int
    step_number: int
    metrics: dict[str, Any]
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str


class Model(_Obj):
    id: str
    created: int
    owned_by: str


class ApiKeyInfo(_Obj):
    id: str
    name: str
    prefix: str
    created_at: int
    revoked_at: int | None = None
    secret: str | None = None  # only in the answer that created the key
