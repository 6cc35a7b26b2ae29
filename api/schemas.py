"""Request bodies (validated) and the public JSON shape of each object (OpenAI's fields)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from api.models import Checkpoint, File, Job, JobEvent

PosInt = Annotated[int, Field(strict=True, ge=1)]


def _storable(s: str) -> str:
    """Text the database can keep: PostgreSQL refuses NUL in text and in JSON. (Unpaired
    surrogates never get this far: pydantic refuses them while parsing.)"""
    if "\x00" in s:
        raise ValueError("must not contain NUL characters")
    return s


Text = Annotated[str, AfterValidator(_storable)]


class MemorySettings(BaseModel):
    """Swap Core: what the backward recomputes and where kept activations live (the engine's
    MemorySpec; README's "Memory" section)."""

    model_config = ConfigDict(extra="forbid")
    recompute: Literal["none", "full", "selective"] = "none"
    cache_ops: list[Literal["mm", "bmm", "grouped_mm", "attention", "kernels", "projections", "experts"]] = Field(
        ["kernels"], max_length=7
    )
    tier: Literal["device", "host", "auto"] = "device"
    quantize: Literal["none", "fp8", "int8"] = "none"
    device_budget_mb: Annotated[float, Field(ge=0)] | None = Field(
        None, description="tier auto: device memory the cache may hold"
    )
    blocks: list[Literal["attention", "mlp"]] = Field(
        ["attention", "mlp"], min_length=1, max_length=2, description="the sublayers recomputed"
    )


class ParallelSettings(BaseModel):
    """Processes for the job on one worker node (one per GPU; gloo on a CPU worker), how many
    ways the experts are split and how many ranks share one sequence (context parallel) (the
    engine's ParallelSpec; README's "Multi-GPU" section)."""

    model_config = ConfigDict(extra="forbid")
    nproc: Annotated[int, Field(strict=True, ge=1, le=64)] = 1
    ep_size: Annotated[int, Field(strict=True, ge=1, le=64)] = 1
    cp_size: Annotated[int, Field(strict=True, ge=1, le=64)] = 1

    @model_validator(mode="after")
    def _ep_divides(self) -> ParallelSettings:
        for name in ("ep_size", "cp_size"):
            if self.nproc % getattr(self, name):
                raise ValueError(f"{name} ({getattr(self, name)}) must divide nproc ({self.nproc})")
        return self


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_epochs: Literal["auto"] | Annotated[int, Field(strict=True, ge=1, le=50)] = "auto"
    batch_size: Literal["auto"] | Annotated[int, Field(strict=True, ge=1, le=256)] = "auto"
    learning_rate_multiplier: Literal["auto"] | Annotated[float, Field(gt=0, le=100)] = "auto"
    # Kiln extras: the OpenAI SDK passes them on unchanged.
    checkpoint_interval: PosInt | None = Field(None, description="steps between checkpoints; default once per epoch")
    max_steps: PosInt | None = Field(None, description="stop after this many optimizer steps")
    max_seq_len: Annotated[int, Field(strict=True, ge=16, le=1 << 20)] | None = None
    warmup_ratio: Annotated[float, Field(ge=0, le=0.5)] | None = None
    gradient_accumulation_steps: Annotated[int, Field(strict=True, ge=1, le=256)] | None = None
    packing: Annotated[bool, Field(strict=True)] | None = Field(
        None, description="pack short examples into full rows (default on)"
    )
    group_by_length: Annotated[bool, Field(strict=True)] | None = None
    validation_split: Annotated[float, Field(ge=0, le=0.5)] | None = Field(
        None, description="fraction of the training file held out for validation when no validation_file is given"
    )
    memory: MemorySettings | None = Field(None, description="activation recompute and caching (Swap Core)")
    parallel: ParallelSettings | None = Field(None, description="processes (GPUs) and expert-parallel size")


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: Annotated[int, Field(strict=True, ge=1, le=1024)] = 8
    alpha: Annotated[float, Field(gt=0, le=4096)] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[str] | None = Field(None, min_length=1)
    target_parameters: list[str] | None = Field(
        None, description="grouped expert weights, e.g. mlp.experts.gate_up_proj"
    )


class Supervised(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: Hyperparameters | None = None


class Method(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised"]
    supervised: Supervised | None = None


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=200)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    images_file: str | None = Field(None, max_length=64, description="zip of the images the JSONL names")
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    lora: LoraSettings | None = None
    suffix: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    seed: Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)] | None = None
    metadata: dict[Text, Text] | None = None
    integrations: list[Any] | None = None

    def resolved_hyperparameters(self) -> Hyperparameters:
        if self.method and self.method.supervised and self.method.supervised.hyperparameters:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or Hyperparameters()


def file_public(f: File) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": f.status,
        "status_details": f.status_details,
        "expires_at": None,
        "stats": f.stats,
    }


def job_public(j: Job) -> dict[str, Any]:
    hp = {k: j.hyperparameters.get(k, "auto") for k in ("n_epochs", "batch_size", "learning_rate_multiplier")}
    extras = {k: v for k, v in j.hyperparameters.items() if k not in hp}
    return {
        "id": j.id,
        "object": "fine_tuning.job",
        "created_at": j.created_at,
        "error": j.error,
        "fine_tuned_model": j.fine_tuned_model,
        "finished_at": j.finished_at,
        "hyperparameters": hp,
        "model": j.model,
        "organization_id": j.owner,
        "result_files": [],
        "seed": j.seed,
        "status": j.status,
        "trained_tokens": j.trained_tokens,
        "training_file": j.training_file,
        "validation_file": j.validation_file,
        "estimated_finish": None,
        "integrations": [],
        "metadata": j.meta,
        "suffix": j.suffix,
        "method": {"type": "supervised", "supervised": {"hyperparameters": {**hp, **extras}}},
        # Kiln extras
        "images_file": j.images_file,
        "lora": j.lora,
        "started_at": j.started_at,
        "cancel_requested": j.cancel_requested,
        "attempt": j.attempt,
    }


def event_public(e: JobEvent) -> dict[str, Any]:
    return {
        "id": e.id,
        "object": "fine_tuning.job.event",
        "created_at": e.created_at,
        "level": e.level,
        "message": e.message,
        "data": e.data,
        "type": e.type,
    }


def checkpoint_public(c: Checkpoint, job: Job) -> dict[str, Any]:
    base = job.fine_tuned_model or f"ft:{job.model}:{job.owner}::{job.id}"
    return {
        "id": c.id,
        "object": "fine_tuning.job.checkpoint",
        "created_at": c.created_at,
        "fine_tuned_model_checkpoint": f"{base}:ckpt-step-{c.step}",
        "fine_tuning_job_id": job.id,
        "metrics": {"step": c.step, **c.metrics},
        "step_number": c.step,
    }


def page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "has_more": has_more,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
    }
