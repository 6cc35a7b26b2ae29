"""The merged export of a fine-tuned model as the API shows it (``/v1/models/{model}/export``): the
response model of the server's routes and the SDK's typed object, one class for both."""

from __future__ import annotations

from typing import Literal

from kiln.types import JobError, _Obj

EXPORT_STATES = ("queued", "running", "succeeded", "failed")


class Export(_Obj):
    """A fine-tuned model with its adapter merged into the base's weights, zipped: ``status``
    queued | running | succeeded | failed (``error`` says why; a POST starts it again). Once
    succeeded, ``bytes`` is the archive's size, ``model_type`` its config.json's (the family's
    on-disk layout: ``kimi_linear`` loads in transformers) and ``dtypes`` its tensors' dtypes."""

    id: str
    object: Literal["model.export"] = "model.export"
    model: str
    base_model: str
    fine_tuning_job_id: str
    status: Literal["queued", "running", "succeeded", "failed"]
    created_at: int
    finished_at: int | None = None
    format: Literal["safetensors"] = "safetensors"
    bytes: int | None = None
    model_type: str | None = None
    dtypes: list[str] = []
    error: JobError | None = None

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")
