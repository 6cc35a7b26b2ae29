"""The hybrid on disk, Kiln's own layout: config.json (``model_type`` kiln_hybrid, the ModelConfig
under ``model``, the image token's id) and model.safetensors under the module names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model.hybrid.model import HybridForCausalLM


def config_from_json(raw: dict) -> ModelConfig:
    return ModelConfig.from_json(json.dumps(raw["model"]))


def build(raw: dict) -> HybridForCausalLM:
    """The model config.json describes, on the default device, its weights unset."""
    return HybridForCausalLM(config_from_json(raw), raw.get("image_token_id"))


def save_hybrid(model: HybridForCausalLM, folder: Path) -> None:
    """config.json (model_type kiln_hybrid, the ModelConfig) + model.safetensors, module names."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "kiln_hybrid",
        "image_token_id": model.image_token_id,
        "model": json.loads(model.config.to_json()),
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_hybrid(folder: Path) -> HybridForCausalLM:
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    with torch.device("meta"):
        model = build(raw)
    model.load_state_dict(load_file(str(folder / "model.safetensors")), assign=True, strict=True)
    return model
