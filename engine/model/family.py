"""What a model family declares: one ``Family`` per folder of ``engine/model`` (tiny, kimi_linear,
hybrid, deepseek_v32), which ``engine.model.registry`` collects. torchtitan's habit: a spec per
family with its own state-dict adapter (``<family>/hf.py``); the model code is single-device, and
LoRA, recompute, parallelism and checkpoints are applied from outside.

The facts the service states about a family's built-in models (LoRA targets, experts, position
limit, image tokens) are their ``kiln.catalog`` cards, torch-free, which the API reads too; a
family's ``experts``, ``position_limit`` and ``image_tokens`` compute the same facts from a config
(tests/unit/test_families.py holds them equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from kiln.catalog import ModelCard, Targets

BUILTIN_SEED = 20261202  # every built-in model's weights come from it: every machine makes the same


@dataclass(frozen=True)
class Builtin:
    """A built-in model: its card and how its files are written (from ``BUILTIN_SEED``, in the
    family's on-disk format, into an empty folder)."""

    card: ModelCard
    write: Callable[[Path], None]


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's ``model_type``
    model_class: type[nn.Module]  # what ``build`` and ``load`` make
    config: Callable[[dict], Any]  # config.json -> the model's config
    build: Callable[[dict], nn.Module]  # config.json -> the model, on the default device, weights unset
    load: Callable[[Path], nn.Module]  # a folder -> the model with its weights (the family's HF adapter)
    save: Callable[[Any, Path], None] | None  # the model (the family's class) -> a folder ``load`` reads; None: none
    lora: Targets  # LoRA targets and defaults
    experts: Callable[[Any], int]  # config -> routed experts per MoE layer (0: no MoE)
    position_limit: Callable[[Any], int | None]  # config -> the longest sequence (None: no limit)
    image_tokens: Callable[[Any], int | None]  # config -> tokens an image fills (None: text only)
    builtins: tuple[Builtin, ...] = ()
