"""kiln-tiny on disk: config.json (the TinyConfig, ``model_type`` kiln_tiny) and
model.safetensors under the module names."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.model.tiny.model import TinyConfig, TinyForCausalLM


def save_pretrained(model: TinyForCausalLM, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({**asdict(model.config), "architectures": ["KilnTinyForCausalLM"]}, indent=2)
    )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


def config_from_json(raw: dict) -> TinyConfig:
    """config.json's TinyConfig fields (the rest, ``architectures``, ignored)."""
    fields = TinyConfig.__dataclass_fields__
    return TinyConfig(**{k: v for k, v in raw.items() if k in fields})


def load_pretrained(folder: Path) -> TinyForCausalLM:
    """Build on the meta device, then take the tensors from the safetensors file as they are."""
    raw = json.loads((folder / "config.json").read_text())
    with torch.device("meta"):
        model = TinyForCausalLM(config_from_json(raw))
    state = load_file(str(folder / "model.safetensors"))
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True, strict=True)
    return model
