"""Base models the service offers and the LoRA targets each one has.

``kiln-tiny`` is the built-in model (the engine creates its weights from a fixed seed on first
use), small enough to fine-tune on a CPU in a minute.
"""
from __future__ import annotations

LLAMA_STYLE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

BASE_MODELS: dict[str, dict] = {
    "kiln-tiny": {"created": 1764633600, "targets": LLAMA_STYLE_TARGETS},
}


def lora_targets(model: str) -> tuple[str, ...]:
    return BASE_MODELS[model]["targets"]
