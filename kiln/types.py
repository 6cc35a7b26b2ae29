"""Typed response objects. Unknown fields are kept (``model_extra``) so a newer server's
additions are not lost."""
from __future__ import annotations

from typing import Any, Optional

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
    code: Optional[str] = None
    message: Optional[str] = None
    param: Optional[str] = None


class Job(_Obj):
    id: str
    status: str
    model: str
    created_at: int
    training_file: str
    validation_file: Optional[str] = None
    fine_tuned_model: Optional[str] = None
    finished_at: Optional[int] = None
    trained_tokens: Optional[int] = None
    hyperparameters: dict[str, Any] = {}
    error: Optional[JobError] = None
    suffix: Optional[str] = None
    seed: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class JobEvent(_Obj):
    id: str
    created_at: int
    level: str
    message: str
    type: str
    data: Optional[dict[str, Any]] = None


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
    revoked_at: Optional[int] = None
    secret: Optional[str] = None  # only in the answer that created the key
