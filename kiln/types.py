"""Typed response objects. Unknown fields are kept (``model_extra``) so a newer server's
additions are not lost."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

TERMINAL = ("succeeded", "failed", "cancelled")


class _Obj(BaseModel):
    model_config = ConfigDict(extra="allow")


class FileObject(_Obj):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None
    stats: dict[str, Any] = {}


class FileDeleted(_Obj):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class JobError(_Obj):
    code: str | None = None
    message: str | None = None
    param: str | None = None


class JobHyperparameters(_Obj):
    n_epochs: int | str = "auto"
    batch_size: int | str = "auto"
    learning_rate_multiplier: float | str = "auto"


class Job(_Obj):
    """A fine-tuning job as the API shows it: OpenAI's fields, then Kiln's (the resolved
    ``lora``, ``images_file``, ``requested``: the settings as the request gave them)."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    status: Literal["validating_files", "queued", "running", "pausing", "paused", "succeeded", "failed", "cancelled"]
    model: str
    created_at: int
    training_file: str
    validation_file: str | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    trained_tokens: int | None = None
    hyperparameters: JobHyperparameters = JobHyperparameters()
    error: JobError | None = None
    suffix: str | None = None
    seed: int | None = None
    organization_id: str | None = None
    result_files: list[str] = []
    estimated_finish: int | None = None
    integrations: list[Any] = []
    metadata: dict[str, str] | None = None
    method: dict[str, Any] | None = None
    images_file: str | None = None
    lora: dict[str, Any] = {}
    requested: dict[str, Any] = {}
    started_at: int | None = None
    cancel_requested: bool = False
    attempt: int = 0

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class JobEvent(_Obj):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class Checkpoint(_Obj):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    step_number: int
    metrics: dict[str, Any]
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str


class Model(_Obj):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    fine_tuning_job_id: str | None = None


class ApiKeyInfo(_Obj):
    id: str
    object: Literal["api_key"] = "api_key"
    name: str
    prefix: str
    created_at: int
    revoked_at: int | None = None
    secret: str | None = None  # only in the answer that created the key


class WebhookEndpoint(_Obj):
    """Where the owner's job events go; ``secret`` (``whsec_…``, Standard Webhooks) only in the
    answer that created it."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    created_at: int
    secret: str | None = None


class WebhookEndpointDeleted(_Obj):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    deleted: bool


class WebhookDelivery(_Obj):
    """One event sent to one endpoint, and how its delivery went: ``id`` is the ``webhook-id``
    header, the same on every attempt."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    webhook_id: str
    event_id: str
    event_type: str
    job_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None = None
    last_error: str | None = None
    last_attempt_at: int | None = None
    next_attempt_at: int | None = None
    delivered_at: int | None = None
    created_at: int


class WebhookEvent(_Obj):
    """A webhook's body, OpenAI's event shape: ``type`` is ``fine_tuning.job.succeeded`` (or
    ``failed``, ``cancelled``, ``paused``) and ``data`` holds the job's ``id``."""

    id: str
    object: Literal["event"] = "event"
    created_at: int
    type: str
    data: dict[str, Any]


class ReportIssue(_Obj):
    line: int | None = None
    field: str | None = None
    message: str


class Estimate(_Obj):
    """How long training the dataset takes, from finished jobs on the model (``basis`` says which,
    ``confidence`` none | low | medium | high), with a range."""

    n_epochs: int
    training_tokens: int
    seconds: float
    low: float
    high: float
    confidence: Literal["none", "low", "medium", "high"]
    worker_kind: str | None = None
    basis: str


class DatasetReport(_Obj):
    object: Literal["dataset.report"] = "dataset.report"
    file_id: str
    model: str
    ok: bool
    issues: list[ReportIssue]
    issues_truncated: bool
    max_seq_len: int | None = None
    position_limit: int | None = None
    stats: dict[str, Any]
    estimate: Estimate


class Usage(_Obj):
    prompt_tokens: int
    completion_tokens: int  # all choices together
    total_tokens: int


class ChatCompletionMessage(_Obj):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class ChatChoice(_Obj):
    index: int
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length"]  # stop: the end of the turn or a stop string; length: max_tokens
    logprobs: None = None


class ChatCompletion(_Obj):
    """``POST /v1/chat/completions``' answer (OpenAI's ``chat.completion``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChoiceDelta(_Obj):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Obj):
    index: int
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(_Obj):
    """One Server-Sent Event of a streamed chat completion: per choice a first chunk with
    ``delta.role``, then ``delta.content`` pieces, then one with its ``finish_reason``; with
    ``stream_options.include_usage`` every chunk has ``usage`` null but a last one with no
    choices and the usage; then ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


T = TypeVar("T")


class ListOf(_Obj, Generic[T]):
    """A page of a list: ``data``, and the cursor fields OpenAI's lists carry."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class ErrorBody(_Obj):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    request_id: str | None = None  # also the x-request-id header: quote it when asking for help


class ErrorResponse(_Obj):
    """Every error: OpenAI's shape (a dataset's errors add ``issues`` inside ``error``)."""

    error: ErrorBody
