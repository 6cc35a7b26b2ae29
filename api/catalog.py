"""Base models the service offers and the LoRA targets each one has.

``kiln-tiny`` is the built-in model (the engine creates its weights from a fixed seed on first
use), small enough to fine-tune on a CPU in a minute.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from kiln.dataset import Example, LengthBound
from kiln.tokenizer import chat_template, encode_chat, load_tokenizer

LLAMA_STYLE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# tokens_per_second: training throughput used for time estimates; kiln-tiny's was measured on
# the 2-core development VM (CPU, sample dataset, batch 8): 4,000-5,000 tokens/s.
KIMI_LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "g_a_proj", "g_b_proj", "f_a_proj",
                       "f_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# experts: routed experts per MoE layer (parallel.ep_size must divide it). image_tokens None: a text-only model.
# position_limit: the longest sequence the model's positions allow (kiln-tiny's max_position_embeddings, the
# hybrid's RoPE max_seq_len); None: no limit (Kimi Linear: KDA and NoPE attention), any length that fits.
# context_parallel: the family splits one sequence over ranks (parallel.cp_size > 1; KDA + MLA or DSA models).
# tokens_per_second only feeds the report's time estimate:
# kiln-tiny's was measured (above); the two others are rough guesses for the reference kernels on
# the 2-core VM, not measurements.
BASE_MODELS: dict[str, dict] = {
    "kiln-tiny": {"created": 1764633600, "targets": LLAMA_STYLE_TARGETS, "default_targets": LLAMA_STYLE_TARGETS,
                  "parameters": (), "experts": 0, "position_limit": 2048, "image_tokens": 16, "tokens_per_second": 4000},
    "kimi-linear-tiny": {"created": 1796256000, "targets": KIMI_LINEAR_TARGETS,
                         "default_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                         "parameters": EXPERT_PARAMETERS, "experts": 8, "position_limit": None, "context_parallel": True, "image_tokens": None,
                         "tokens_per_second": 1000},
    "kiln-hybrid-tiny": {"created": 1796256000, "targets": KIMI_LINEAR_TARGETS + ("q_a_proj", "q_b_proj", "g_proj"),
                         "default_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "gate_proj",
                                             "up_proj", "down_proj"),
                         "parameters": EXPERT_PARAMETERS, "experts": 4, "position_limit": 4096, "context_parallel": True, "image_tokens": 16,
                         "tokens_per_second": 500},
}


def length_bound(model: str, requested: int | None, param: str = "hyperparameters.max_seq_len") -> LengthBound:
    """The job's bound on example length (kiln.dataset.LengthBound); a ``max_seq_len`` over the
    model's position limit is a 400 naming both."""
    from api.errors import ApiError

    try:
        return LengthBound(model, BASE_MODELS[model]["position_limit"], requested)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="max_seq_len_too_large") from e


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
