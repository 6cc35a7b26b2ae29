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
KIMI_LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "g_a_proj", "g_b_proj", "f_a_proj",
                       "f_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# experts: routed experts per MoE layer (parallel.ep_size must divide it). image_tokens None: a text-only model. tokens_per_second only feeds the report's time estimate:
# kiln-tiny's was measured (above); the two others are rough guesses for the reference kernels on
# the 2-core VM, not measurements.
BASE_MODELS: dict[str, dict] = {
    "kiln-tiny": {"created": 1764633600, "targets": LLAMA_STYLE_TARGETS, "default_targets": LLAMA_STYLE_TARGETS,
                  "parameters": (), "experts": 0, "max_seq_len": 2048, "image_tokens": 16, "tokens_per_second": 4000},
    "kimi-linear-tiny": {"created": 1796256000, "targets": KIMI_LINEAR_TARGETS,
                         "default_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                         "parameters": EXPERT_PARAMETERS, "experts": 8, "max_seq_len": 4096, "image_tokens": None,
                         "tokens_per_second": 1000},
    "kiln-hybrid-tiny": {"created": 1796256000, "targets": KIMI_LINEAR_TARGETS + ("q_a_proj", "q_b_proj", "g_proj"),
                         "default_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "gate_proj",
                                             "up_proj", "down_proj"),
                         "parameters": EXPERT_PARAMETERS, "experts": 4, "max_seq_len": 4096, "image_tokens": 16,
                         "tokens_per_second": 500},
}


def tokenizer_for(model: str, store_models: Path):
    """The model's tokenizer and chat template, from its folder in the store (the byte-level
    default when the folder has no tokenizer files, as for kiln-tiny)."""
    tok = load_tokenizer(store_models / model)
    return tok, chat_template(tok)


def token_counter(model: str, store_models: Path) -> Callable[[Example], tuple[int, int]]:
    tok, tpl = tokenizer_for(model, store_models)
    image_tokens = BASE_MODELS[model]["image_tokens"]

    def count(ex: Example) -> tuple[int, int]:
        if ex.images and image_tokens is None:
            raise ValueError(f"{model} takes no image input")
        ids, target = encode_chat(tok, tpl, ex, image_tokens or 0)
        return len(ids), sum(target)

    return count
