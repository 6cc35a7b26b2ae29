"""Hugging Face checkpoints (config.json + safetensors, one file or a sharded index) into our
models, as every family's adapter (``engine/model/<family>/hf.py``) reads them: the model built on
the meta device, then each tensor streamed from disk into place, so only what is loaded is ever
materialised. Per-expert tensors on disk (``names.EXPERT_KEY``) are stacked into our grouped
``gate_up_proj`` [E, 2I, D] (gate rows first, then up) and ``down_proj`` [E, D, I].
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model.common import names

# a per-expert part on disk -> its rows in our grouped tensors
_ROLE = {
    part: {("gate_up_proj", 0): "gate", ("gate_up_proj", 1): "up", ("down_proj", 0): "down"}[place]
    for part, place in names.PART_OF.items()
}


def shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / f for f in files]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    return [single]


def read_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time."""
    for path in shards(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def put(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, leaf)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, model expects {tuple(old.shape)}")
    if isinstance(old, nn.Parameter):
        setattr(module, leaf, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        module.register_buffer(leaf, value)


class ExpertStacker:
    """Per-expert tensors from disk into the grouped [E, 2I, D] (gate rows, then up) and
    [E, D, I] tensors, each filled in place as its experts arrive."""

    def __init__(self, E: int, I: int, dtype: torch.dtype):
        self.E, self.I, self.dtype = E, I, dtype
        self.groups: dict[str, dict] = {}

    def add(self, key: str, t: torch.Tensor) -> bool:
        m = names.EXPERT_KEY.match(key)
        if not m:
            return False
        prefix, e, role = m.group(1), int(m.group(2)), _ROLE[m.group(3)]
        g = self.groups.setdefault(prefix, {"gate_up": None, "down": None, "seen": set()})
        if role == "down":
            if g["down"] is None:
                g["down"] = torch.empty(self.E, *t.shape, dtype=self.dtype)
            g["down"][e] = t
        else:
            if g["gate_up"] is None:
                g["gate_up"] = torch.empty(self.E, 2 * self.I, t.shape[1], dtype=self.dtype)
            g["gate_up"][e, slice(0, self.I) if role == "gate" else slice(self.I, 2 * self.I)] = t
        g["seen"].add((e, role))
        return True

    def finish(self, model: nn.Module) -> set[str]:
        done = set()
        for prefix, g in self.groups.items():
            missing = {(e, r) for e in range(self.E) for r in ("gate", "up", "down")} - g["seen"]
            if missing:
                raise ValueError(f"{prefix}: checkpoint lacks experts {sorted(missing)[:5]}")
            put(model, f"{prefix}.gate_up_proj", g["gate_up"])
            put(model, f"{prefix}.down_proj", g["down"])
            done |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
        return done


def stream_into(
    model: nn.Module,
    folder: Path,
    dtype: torch.dtype,
    experts: ExpertStacker,
    rename: Callable[[str, torch.Tensor], str | None],
) -> set[str]:
    """Every checkpoint tensor into its place: ``rename`` maps a disk name to a module name (None
    when it took the tensor itself), then per-expert tensors are stacked and the rest put in
    place. Returns what was loaded; raises on tensors without a place."""
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    loaded, unexpected = set(), []
    for disk, t in read_tensors(folder):
        t = t.to(dtype)
        key = rename(disk, t)
        if key is None or experts.add(key, t):
            continue
        if key not in expected:
            unexpected.append(key)
            continue
        put(model, key, t)
        loaded.add(key)
    if unexpected:
        raise ValueError(f"{folder}: tensors the model has no place for: {unexpected[:5]}")
    return loaded | experts.finish(model)


def check_complete(model: nn.Module, folder: Path, loaded: set[str]) -> None:
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {sorted(missing)[:5]}")
