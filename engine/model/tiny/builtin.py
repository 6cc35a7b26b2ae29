"""The built-in kiln-tiny: TinyConfig's defaults, GPT-2's initialisation from the fixed seed."""

from __future__ import annotations

from pathlib import Path

from engine.model.family import BUILTIN_SEED
from engine.model.tiny.hf import save_pretrained
from engine.model.tiny.model import TinyConfig, TinyForCausalLM, init_weights


def write_tiny(folder: Path) -> None:
    model = TinyForCausalLM(TinyConfig())
    init_weights(model, BUILTIN_SEED)
    save_pretrained(model, folder)
