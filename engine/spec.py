"""What the worker hands the engine: a plain job spec, a store and a reporter.

The spec round-trips through JSON (``to_json``/``from_json``): it is what a job runs with, and
nothing in it refers to the database or the API.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol


@dataclass
class LoraSpec:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # Grouped expert weights, PEFT's names: "mlp.experts.gate_up_proj", "mlp.experts.down_proj".
    target_parameters: list[str] = field(default_factory=list)


@dataclass
class MemorySpec:
    """Swap Core (engine/memory/swap_core.py): what the backward recomputes and where kept
    activations live. ``recompute``: none | full (each attention and MLP block recomputed) |
    selective (the outputs of ``cache_ops`` kept, the rest recomputed; default the Triton kernels'
    forwards, the most recompute saved per byte kept: bench/RESULTS.md, "Swap Core: the kernels'
    forwards kept"). ``tier``: device | host
    (pinned, async copies) | auto (the device for the last ``device_budget_mb`` of each forward's
    kept outputs, the host before them). ``quantize``:
    none | fp8 | int8: keep 16-bit outputs in one byte an element with a scale per 32.
    ``blocks``: which sublayers of each decoder layer are recomputed (attention, mlp); the others
    keep their activations as without recompute."""

    recompute: Literal["none", "full", "selective"] = "none"
    cache_ops: list[str] = field(default_factory=lambda: ["kernels"])
    tier: Literal["device", "host", "auto"] = "device"
    quantize: Literal["none", "fp8", "int8"] = "none"
    device_budget_mb: float | None = None  # tier auto: device bytes the cache may hold
    blocks: list[str] = field(default_factory=lambda: ["attention", "mlp"])


@dataclass
class ParallelSpec:
    """Processes on this node (one per GPU; gloo on a CPU machine), how many ways the experts
    are split (``ep_size`` divides ``nproc`` and the expert count) and how many consecutive
    ranks share one sequence (``cp_size``, context parallel: each takes a contiguous slice of the
    step's rows laid end to end; divides ``nproc``). 1: one process, as always."""

    nproc: int = 1
    ep_size: int = 1
    cp_size: int = 1


def check_parallel(p: ParallelSpec) -> None:
    """ValueError naming the field, for settings that cannot run."""
    if not isinstance(p.nproc, int) or p.nproc < 1:
        raise ValueError(f"parallel.nproc must be a positive integer, got {p.nproc!r}")
    if not isinstance(p.ep_size, int) or p.ep_size < 1 or p.nproc % p.ep_size:
        raise ValueError(
            f"parallel.ep_size must be a positive divisor of parallel.nproc ({p.nproc}), got {p.ep_size!r}"
        )
    if not isinstance(p.cp_size, int) or p.cp_size < 1 or p.nproc % p.cp_size:
        raise ValueError(
            f"parallel.cp_size must be a positive divisor of parallel.nproc ({p.nproc}), got {p.cp_size!r}"
        )


@dataclass
class JobSpec:
    job_id: str
    model: str  # base model name; its weights are in store.model_dir(model)
    training_file: str  # local path: a JSONL file or a zip holding one
    validation_file: str | None = None
    images_file: str | None = None  # local path of a zip of images
    n_epochs: int | Literal["auto"] = "auto"
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    checkpoint_interval: int | None = None  # steps; None: once per epoch
    max_steps: int | None = None
    max_seq_len: int | None = None  # None: the model's maximum
    warmup_ratio: float = 0.05
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step: same update, less memory
    packing: bool = True  # several short examples per row, attention kept inside each
    group_by_length: bool = False  # batches of similar lengths: less padding, but on mixed data (the
    # sample set: short text and longer image questions) task-uniform batches slowed convergence
    validation_split: float = 0.0  # held out of the training file when there is no validation file
    seed: int = 0
    training: Literal["lora", "full"] = "lora"  # full: every parameter (pretraining, the convergence bench)
    moe_bias_rate: float = 1e-3  # full training: aux-loss-free router balancing step (K3: ~1e-3)
    lora: LoraSpec = field(default_factory=LoraSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    resume_from: str | None = None  # store key of a checkpoint folder

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        d = json.loads(text)
        d["lora"] = LoraSpec(**d.get("lora", {}))
        d["memory"] = MemorySpec(**d.get("memory", {}))
        d["parallel"] = ParallelSpec(**d.get("parallel", {}))
        return cls(**d)

    @property
    def artifacts(self) -> str:
        return f"jobs/{self.job_id}"


class Store(Protocol):
    def path(self, key: str) -> Path: ...
    def publish_dir(self, key: str) -> AbstractContextManager[Path]: ...
    def publish_file(self, key: str) -> AbstractContextManager[Path]: ...
    def model_dir(self, name: str) -> Path: ...


class Reporter(Protocol):
    def message(self, text: str, level: str = "info", data: dict[str, Any] | None = None) -> None: ...
    def metrics(self, step: int, values: dict[str, Any]) -> None: ...
    def checkpoint(self, step: int, key: str, metrics: dict[str, Any]) -> None: ...
    def resolved(self, hyperparameters: dict[str, Any]) -> None: ...
    def should_stop(self) -> str | None:
        """'cancel' when the user cancelled, 'lease_lost' when another worker took the job."""


@dataclass
class TrainResult:
    status: Literal["succeeded", "stopped"]
    adapter_key: str | None = None
    trained_tokens: int = 0
    stop_reason: str | None = None
    final_metrics: dict[str, Any] = field(default_factory=dict)
