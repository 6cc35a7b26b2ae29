"""The job contract, one typed form from HTTP to the trainer (torch-free, pydantic, unknown fields
refused):

- ``Hyperparameters`` (with ``LoraSpec``, ``MemorySpec``, ``ParallelSpec``): every setting a job
  may ask for, each declared once with its bound and its default;
- ``JobRequest``: the body of ``POST /v1/fine_tuning/jobs``, which the API validates, the SDK's
  ``jobs.create`` sends and the web page posts;
- ``resolve``: a request's settings with every default filled from the model's card
  (``kiln.catalog``), which the database keeps beside the request as it came;
- ``JobSpec``: what the engine runs (``Hyperparameters`` plus the files' paths and the job's
  identity), which the worker builds from the resolved settings and ``python -m engine.cli``
  loads from YAML.

A new hyperparameter is one field on ``Hyperparameters`` and its use in the engine.
``explain`` turns a ``ValidationError`` into the one-line message every entry point prints.
"""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any, Literal

from annotated_types import Interval
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    Strict,
    ValidationError,
    model_validator,
)

from kiln.catalog import CARDS, LLAMA_STYLE_TARGETS, ModelCard
from kiln.dataset import LengthBound


def _whole(v: Any) -> Any:
    """JSON Schema's integer: 3 or 3.0, never "3" or true."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Whole = BeforeValidator(_whole)  # last: it runs first, and Strict() still refuses strings and booleans
StrictPos = Annotated[int, Strict(), Interval(ge=1), Whole]
Auto = Literal["auto"]


def _storable(s: str) -> str:
    """Text the database can keep: PostgreSQL refuses NUL in text and in JSON. (Unpaired
    surrogates never get this far: pydantic refuses them while parsing.)"""
    if "\x00" in s:
        raise ValueError("must not contain NUL characters")
    return s


Text = Annotated[str, AfterValidator(_storable)]


class SpecError(ValueError):
    """Settings that cannot hold together (two fields, or a field and the model); ``param`` names
    the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _names(kind: str) -> list[JsonValue]:
    """Every LoRA target some model has (the schema's list; each model takes its own: resolve)."""
    return sorted({n for card in CARDS.values() for n in getattr(card.lora, kind)})


class LoraSpec(_Spec):
    """The adapter: rank, alpha (scale alpha / rank), dropout on its input, and what it wraps.
    ``target_modules`` left out: the model's defaults (its card's ``lora.defaults``; the list
    below for a model without a card)."""

    rank: Annotated[int, Strict(), Interval(ge=1, le=1024), Whole] = 8
    alpha: Annotated[float, Strict(), Field(gt=0, le=4096)] = 16.0
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0
    target_modules: list[Text] = Field(
        list(LLAMA_STYLE_TARGETS),
        min_length=1,
        max_length=64,
        description="last names of the linear layers LoRA wraps (which ones a model has: its card); default the "
        "model's",
        json_schema_extra={"items": {"type": "string", "enum": _names("modules")}},
    )
    target_parameters: list[Text] = Field(
        [],
        max_length=8,
        description="grouped expert weights, e.g. mlp.experts.gate_up_proj",
        json_schema_extra={"items": {"type": "string", "enum": _names("parameters")}},
    )


class MemorySpec(_Spec):
    """Swap Core (engine/memory/swap_core.py): what the backward recomputes and where kept
    activations live. ``recompute``: none | full (each attention and MLP block recomputed) |
    selective (the outputs of ``cache_ops`` kept, the rest recomputed; default the Triton kernels'
    forwards, the most recompute saved per byte kept). ``tier``: device | host (pinned, async
    copies) | auto (the device for the last ``device_budget_mb`` of each forward's kept outputs,
    the host before them). ``quantize``: keep 16-bit outputs in one byte an element with a scale
    per 32. ``blocks``: which sublayers of each decoder layer are recomputed."""

    recompute: Literal["none", "full", "selective"] = "none"
    cache_ops: list[Literal["mm", "bmm", "grouped_mm", "attention", "kernels", "projections", "experts"]] = Field(
        ["kernels"], max_length=7, description="selective: the op classes whose outputs are kept"
    )
    tier: Literal["device", "host", "auto"] = "device"
    quantize: Literal["none", "fp8", "int8"] = "none"
    device_budget_mb: Annotated[float, Strict(), Field(ge=0)] | None = Field(
        None, description="tier auto: device memory the cache may hold"
    )
    blocks: list[Literal["attention", "mlp"]] = Field(
        ["attention", "mlp"], min_length=1, max_length=2, description="the sublayers recomputed"
    )


class ParallelSpec(_Spec):
    """Processes for the job on one worker node (one per GPU; gloo on a CPU worker), how many
    ways the experts are split (``ep_size`` divides ``nproc`` and the expert count) and how many
    consecutive ranks share one sequence (``cp_size``, context parallel; divides ``nproc``)."""

    nproc: Annotated[int, Strict(), Interval(ge=1, le=64), Whole] = 1
    ep_size: Annotated[int, Strict(), Interval(ge=1, le=64), Whole] = 1
    cp_size: Annotated[int, Strict(), Interval(ge=1, le=64), Whole] = 1

    def check(self, method: str = "supervised") -> None:
        """The rules between the fields (a schema states each field's bounds, not these), and the
        method's: DPO runs in one process for now."""
        if method == "dpo" and self.nproc > 1:
            raise SpecError(
                "hyperparameters.parallel.nproc: method dpo runs in one process (nproc 1) for now",
                "hyperparameters.parallel.nproc",
            )
        for name in ("ep_size", "cp_size"):
            if self.nproc % getattr(self, name):
                raise SpecError(
                    f"hyperparameters.parallel.{name} ({getattr(self, name)}) must divide nproc ({self.nproc})",
                    f"hyperparameters.parallel.{name}",
                )


class Hyperparameters(_Spec):
    """Every training setting a job may ask for. OpenAI's three take ``"auto"`` (the trainer picks
    from the dataset's size: batch min(8, examples / 8), 3 epochs, multiplier 1); the rest are
    Kiln's, which the OpenAI SDK passes on unchanged."""

    n_epochs: Auto | Annotated[int, Strict(), Interval(ge=1, le=1000), Whole] = "auto"
    batch_size: Auto | Annotated[int, Strict(), Interval(ge=1, le=256), Whole] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Strict(), Field(gt=0, le=100)] = "auto"
    checkpoint_interval: StrictPos | None = Field(None, description="steps between checkpoints; default once per epoch")
    max_steps: StrictPos | None = Field(None, description="stop after this many optimizer steps")
    max_seq_len: Annotated[int, Strict(), Interval(ge=16, le=1 << 20), Whole] | None = Field(
        None, description="the longest example in tokens; default the model's position limit (none: any length)"
    )
    warmup_ratio: Annotated[float, Strict(), Field(ge=0, le=0.5)] = Field(0.05, description="share of steps warming up")
    gradient_accumulation_steps: Annotated[int, Strict(), Interval(ge=1, le=256), Whole] = Field(
        1, description="micro-batches per optimizer step: the same update in less memory"
    )
    packing: Annotated[bool, Field(strict=True)] = Field(True, description="pack short examples into full rows")
    group_by_length: Annotated[bool, Field(strict=True)] = Field(
        False, description="batches of similar lengths: less padding, slower convergence on mixed data"
    )
    validation_split: Annotated[float, Strict(), Field(ge=0, le=0.5)] = Field(
        0.0, description="fraction of the training file held out for validation when no validation_file is given"
    )
    beta: Auto | Annotated[float, Strict(), Field(gt=0, le=10)] = Field(
        "auto", description="DPO only: how far the policy may move from the base model (auto: 0.1)"
    )
    memory: MemorySpec = Field(default_factory=MemorySpec, description="activation recompute and caching (Swap Core)")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="processes (GPUs) and their split")


class Supervised(_Spec):
    hyperparameters: Hyperparameters | None = None


class Dpo(_Spec):
    hyperparameters: Hyperparameters | None = None


class Method(_Spec):
    """OpenAI's ``method``: supervised (chat examples) or dpo (preference pairs: ``input``,
    ``preferred_output``, ``non_preferred_output``), each with its hyperparameters."""

    type: Literal["supervised", "dpo"]
    supervised: Supervised | None = None
    dpo: Dpo | None = None


Name = Annotated[str, Strict(), Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/ -]+$")]


class WandbSettings(_Spec):
    project: Name
    name: Name | None = None
    entity: Name | None = None
    tags: list[Name] = Field([], max_length=32)


class Wandb(_Spec):
    """OpenAI's Weights & Biases integration: a run per job in ``project`` (the worker's wandb
    login and mode are the operator's: WANDB_API_KEY, KILN_WANDB_MODE)."""

    type: Literal["wandb"]
    wandb: WandbSettings


class MlflowSettings(_Spec):
    experiment: Name = "kiln"
    run_name: Name | None = None
    tags: dict[Name, Annotated[Text, Field(max_length=500)]] = Field({}, max_length=32)


class Mlflow(_Spec):
    """An MLflow run per job: parameters, each step's metrics, the adapter as an artifact, on the
    server the operator configured (KILN_MLFLOW_TRACKING_URI; never a URI from the request)."""

    type: Literal["mlflow"]
    mlflow: MlflowSettings


def _metadata(d: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    if d is None:
        return d
    if len(d) > 16:
        raise ValueError(f"at most 16 keys, got {len(d)}")
    for k, v in d.items():
        if len(k) > 64:
            raise ValueError(f"key {k[:20]!r}... is {len(k)} characters; at most 64")
        if len(v) > 512:
            raise ValueError(f"the value of {k!r} is {len(v)} characters; at most 512")
    return d


class JobRequest(_Spec):
    """``POST /v1/fine_tuning/jobs``: OpenAI's fields, plus Kiln's ``images_file`` and ``lora``.
    Hyperparameters go at the top level or under ``method.supervised`` (OpenAI's newer place);
    both may be given when they agree."""

    model: str = Field(
        min_length=1,
        max_length=300,
        json_schema_extra={"anyOf": [{"enum": list(CARDS)}, {"pattern": "^(ft:|ftckpt_)"}]},
        description="a base model, or one of your fine-tunes to continue: ft:... (its adapter, a fresh "
        "optimizer), a checkpoint's ft:...:ckpt-step-N or ftckpt_... id (the whole training state)",
    )
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    images_file: str | None = Field(None, max_length=64, description="zip of the images the JSONL names")
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    lora: LoraSpec | None = None
    suffix: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    seed: Annotated[int, Strict(), Interval(ge=0, le=2**31 - 1), Whole] | None = None
    metadata: Annotated[dict[Text, Text] | None, AfterValidator(_metadata)] = Field(
        None, description="up to 16 pairs; keys up to 64 characters, values up to 512"
    )
    integrations: list[Annotated[Wandb | Mlflow, Field(discriminator="type")]] | None = Field(
        None, max_length=2, description="experiment tracking: wandb and/or mlflow (the server's tracking URI)"
    )

    @model_validator(mode="after")
    def _one_of_each(self) -> JobRequest:
        kinds = [i.type for i in self.integrations or []]
        if len(kinds) != len(set(kinds)):
            raise ValueError("integrations: at most one of each type")
        return self

    def requested_hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters as asked for (set fields only), from either place; a field given
        in both with different values is a ``SpecError`` naming both."""
        top = self.hyperparameters.model_dump(exclude_unset=True) if self.hyperparameters else {}
        kind = self.method_type
        for other in ("supervised", "dpo"):
            if other != kind and self.method and getattr(self.method, other) is not None:
                raise SpecError(f"method.{other} is given but method.type is {kind!r}", f"method.{other}")
        part = getattr(self.method, kind) if self.method else None
        nested = part.hyperparameters.model_dump(exclude_unset=True) if part and part.hyperparameters else {}
        for key in sorted(set(top) & set(nested)):
            if top[key] != nested[key]:
                raise SpecError(
                    f"hyperparameters.{key} ({json.dumps(top[key])}) and "
                    f"method.{kind}.hyperparameters.{key} ({json.dumps(nested[key])}) differ; give it once",
                    f"hyperparameters.{key}",
                )
        merged = {**top, **nested}
        if "beta" in merged and kind != "dpo":
            raise SpecError("hyperparameters.beta is DPO's; set method.type to 'dpo'", "hyperparameters.beta")
        return merged

    @property
    def method_type(self) -> Literal["supervised", "dpo"]:
        return self.method.type if self.method else "supervised"


class Resolved(_Spec):
    """A job's settings with every default filled: the hyperparameters, the adapter with its
    target modules, and the example-length bound (None: the model has no position limit and the
    job set none, so any length that fits)."""

    hyperparameters: Hyperparameters
    lora: LoraSpec


def resolve(
    card: ModelCard, hyperparameters: dict[str, Any], lora: dict[str, Any], method: str = "supervised"
) -> Resolved:
    """The request's settings with the card's defaults filled; a setting the model cannot run is
    a ``SpecError`` naming the field and what it can take."""
    hp = Hyperparameters.model_validate(hyperparameters)
    adapter = _with_defaults(LoraSpec.model_validate(lora), card)
    hp.parallel.check(method)
    for field, allowed in (("target_modules", card.lora.modules), ("target_parameters", card.lora.parameters)):
        unknown = [t for t in getattr(adapter, field) if t not in allowed]
        if unknown:
            raise SpecError(
                f"lora.{field}: unknown name(s) {', '.join(unknown)} for {card.name}; "
                f"choose from {', '.join(allowed) or 'none'}" + _did_you_mean(unknown[0], allowed),
                f"lora.{field}",
            )
    ep = hp.parallel.ep_size
    if ep > 1 and (not card.experts or card.experts % ep):
        raise SpecError(
            f"hyperparameters.parallel.ep_size: {ep} does not divide the {card.experts} experts of {card.name}"
            + ("" if card.experts else " (it has none: use 1)"),
            "hyperparameters.parallel.ep_size",
        )
    if hp.parallel.cp_size > 1 and not card.context_parallel:
        able = ", ".join(c.name for c in CARDS.values() if c.context_parallel)
        raise SpecError(
            f"hyperparameters.parallel.cp_size: {card.name} has no context-parallel form yet; use 1 "
            f"(models with one: {able})",
            "hyperparameters.parallel.cp_size",
        )
    try:
        hp.max_seq_len = LengthBound(card.name, card.position_limit, hp.max_seq_len).bound
    except ValueError as e:
        raise SpecError(f"hyperparameters.max_seq_len: {e}", "hyperparameters.max_seq_len") from e
    return Resolved(hyperparameters=hp, lora=adapter)


class JobSpec(Hyperparameters):
    """What the engine runs: the resolved hyperparameters, the files as local paths and the job's
    identity. Round-trips through JSON (``to_json``/``from_json``) for torchrun's ranks; nothing in
    it refers to the database or the API."""

    job_id: str
    model: str  # base model name; its weights are in store.model_dir(model)
    training_file: str  # local path: a JSONL file or a zip holding one
    validation_file: str | None = None
    images_file: str | None = None  # local path of a zip of images
    seed: int = 0
    training: Literal["lora", "full"] = "lora"  # full: every parameter (pretraining, the convergence bench)
    method: Literal["supervised", "dpo"] = "supervised"  # dpo: preference pairs against the base model
    init_adapter: str | None = None  # store key of a checkpoint whose adapter weights start the run
    moe_bias_rate: float = 1e-3  # full training: aux-loss-free router balancing step (K3: ~1e-3)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    resume_from: str | None = None  # store key of a checkpoint folder

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.model_validate_json(text)

    @property
    def artifacts(self) -> str:
        return f"jobs/{self.job_id}"

    @model_validator(mode="after")
    def _model_targets(self) -> JobSpec:
        self.parallel.check(self.method)
        if self.method == "dpo" and self.training != "lora":
            raise SpecError("method dpo trains LoRA (its reference is the base, the adapters off)", "method")
        if self.model in CARDS:
            self.lora = _with_defaults(self.lora, CARDS[self.model])
        return self


def _with_defaults(lora: LoraSpec, card: ModelCard) -> LoraSpec:
    """The adapter with the card's default targets when it names none."""
    if "target_modules" in lora.model_fields_set:
        return lora
    return lora.model_copy(update={"target_modules": list(card.lora.defaults)})


# ---- messages -----------------------------------------------------------------------------
_UNION_TAGS = {"int", "float", "str", "bool", "list", "dict", "none"}


def field_path(loc: tuple) -> str:
    """``("body", "lora", "target_modules", 0)`` -> ``lora.target_modules[0]``; the union branch
    tags pydantic adds (``literal['auto']``, ``constrained-int``, ``int``) are dropped."""
    parts = [
        str(p)
        for p in loc
        if p not in ("body", "query", "path", "header")
        and not (isinstance(p, str) and ("[" in p or "-" in p or p in _UNION_TAGS))
    ]
    out, last = "", None
    for p in parts:
        if p != last or p.isdigit():  # a tagged union's tag is its branch's field: wandb.wandb -> wandb
            out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
        last = p
    return out


def _did_you_mean(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the model that ``path`` leads to (for "did you mean")."""
    for name in path:
        info = model.model_fields.get(name)
        inner = None
        for arg in _args(info.annotation if info else None):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                inner = arg
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _args(tp: Any) -> list[Any]:
    out, todo = [], [tp]
    while todo:
        t = todo.pop()
        out.append(t)
        todo.extend(getattr(t, "__args__", ()))
    return out


def explain(
    err: ValidationError | list[Any], model: type[BaseModel] | None = None, limit: int = 5
) -> tuple[str, str | None]:
    """(one-line message, the first field's path) for a validation error (or its ``errors()``):
    each field once, the branches of a union ('auto' or an int >= 1) joined with "or", an unknown
    field with the known name of ``model`` it is closest to."""
    by_field: dict[str, list[str]] = {}
    for e in err.errors() if isinstance(err, ValidationError) else err:
        loc = tuple(e.get("loc", ()))
        path = field_path(loc)
        msg = e.get("msg", "")
        if e.get("type") == "extra_forbidden" and model is not None:
            parent = [p for p in path.split(".")[:-1] if p and "[" not in p]
            msg = "unknown field" + _did_you_mean(path.rsplit(".", 1)[-1], _fields_at(model, parent))
        msg = msg.removeprefix("Value error, ")
        msgs = by_field.setdefault(path, [])
        if msg not in msgs:
            msgs.append(msg)
    text = "; ".join(f"{f}: {' or '.join(m)}" if f else " or ".join(m) for f, m in list(by_field.items())[:limit])
    return text or "invalid request", next(iter(by_field), "") or None
