"""The model families behind one registry: ``config.json``'s ``model_type`` picks the family (its
config, build, and load / save through its Hugging Face adapter), and the built-in models are
written once, from a fixed seed, in their family's on-disk format.

- ``kiln-tiny`` (``tiny``): a small Llama-style decoder with a patch-embedding image encoder.
- ``kimi-linear-tiny`` (``kimi_linear``): Kimi Linear (3 KDA blocks : 1 MLA block, sigmoid-routed
  MoE) at test size, saved in Kimi's checkpoint layout; text only.
- ``kiln-hybrid-tiny`` (``hybrid``): the K3-style hybrid (KDA + Gated DSA, LatentMoE with SiTU,
  Block AttnRes, an image encoder) at test size, in Kiln's own layout (module names).
- ``deepseek_v32``: DeepSeek V3.2 checkpoints as the hybrid model; no built-in one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.model import deepseek_v32, hybrid, kimi_linear, tiny
from engine.model.family import Family

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (tiny.FAMILY, kimi_linear.FAMILY, deepseek_v32.FAMILY, hybrid.FAMILY)
}
LOADERS: dict[str, Callable[[Path], nn.Module]] = {kind: f.load for kind, f in FAMILIES.items()}
BUILTINS: dict[str, Callable[[Path], None]] = {b.card.name: b.write for f in FAMILIES.values() for b in f.builtins}


def _family(folder: Path, raw: dict) -> Family:
    kind = raw.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{folder}: model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def ensure_builtin(name: str, folder: Path) -> None:
    """Write a built-in model's files once; every machine gets the same weights."""
    if (folder / "config.json").exists() or name not in BUILTINS:
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
    BUILTINS[name](tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another worker made it first
        shutil.rmtree(tmp, ignore_errors=True)


def load_base(folder: Path) -> nn.Module:
    """The model in ``folder`` with its weights, by its family's loader."""
    return _family(folder, json.loads((folder / "config.json").read_text())).load(folder)


def save_base(model: nn.Module, folder: Path) -> None:
    """A trained model in its family's on-disk format, loadable as a base model again."""
    for family in FAMILIES.values():
        if family.save is not None and isinstance(model, family.model_class):
            family.save(model, folder)
            return
    raise ValueError(f"no on-disk format for {type(model).__name__}")


def build_meta(folder: Path) -> nn.Module:
    """The model a folder's config.json describes, on the meta device (no memory, no weights):
    the start of a sharded load (shard, ``to_empty``, then load only the local shards)."""
    raw = json.loads((folder / "config.json").read_text())
    family = _family(folder, raw)
    with torch.device("meta"):
        return family.build(raw)


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence a model's positions allow; None: no limit (Kimi Linear, and a hybrid
    whose attention has no RoPE, as K3's: KDA carries order), any length that fits. The API's
    catalog holds the same numbers for the built-in models (tested)."""
    for family in FAMILIES.values():
        if isinstance(model, family.model_class):
            return family.position_limit(model.config)
    return None
