"""Base models the service offers and the LoRA targets each one has.

``kiln-tiny`` is the built-in model (the engine creates its weights from a fixed seed on first
use), small enough to fine-tune on a CPU in a minute.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from kiln.dataset import Example
from kiln.tokenizer import chat_template, encode_chat, load_tokenizer

LLAMA_STYLE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# tokens_per_second: training throughput used for time estimates; kiln-tiny's was measured on
# the 2-core development VM (CPU, sample dataset, batch 8): 4,000-5,000 tokens/s.
BASE_MODELS: dict[str, dict] = {
    "kiln-tiny": {"created": 1764633600, "targets": LLAMA_STYLE_TARGETS, "max_seq_len": 2048,
                  "image_tokens": 16, "tokens_per_second": 4000},
}


def lora_targets(model: str) -> tuple[str, ...]:
    return BASE_MODELS[model]["targets"]


def tokenizer_for(model: str, store_models: Path):
    """The model's tokenizer and chat template, from its folder in the store (the byte-level
    default when the folder has no tokenizer files, as for kiln-tiny)."""
    tok = load_tokenizer(store_models / model)
    return tok, chat_template(tok)


def token_counter(model: str, store_models: Path) -> Callable[[Example], tuple[int, int]]:
    tok, tpl = tokenizer_for(model, store_models)
    image_tokens = BASE_MODELS[model]["image_tokens"]

    def count(ex: Example) -> tuple[int, int]:
        ids, target = encode_chat(tok, tpl, ex, image_tokens)
        return len(ids), sum(target)

    return count
