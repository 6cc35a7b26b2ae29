"""Base models the service offers and the LoRA targets each one has, read from their cards in
``kiln.catalog`` (torch-free; the engine's model families hold the same cards).

``kiln-tiny`` is the built-in model (the engine creates its weights from a fixed seed on first
use), small enough to fine-tune on a CPU in a minute.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.catalog import CARDS
from kiln.dataset import Example, LengthBound
from kiln.tokenizer import chat_template, encode_chat, load_tokenizer

# each built-in model's card (kiln.catalog, which the engine's model families read too), as the
# rows the routes and services look up: created, targets, default_targets, parameters, experts,
# position_limit, context_parallel, image_tokens, tokens_per_second
BASE_MODELS: dict[str, dict] = {name: card.row() for name, card in CARDS.items()}


def length_bound(model: str, requested: int | None, param: str = "hyperparameters.max_seq_len") -> LengthBound:
    """The job's bound on example length (kiln.dataset.LengthBound); a ``max_seq_len`` over the
    model's position limit is a 400 naming both."""
    from api.errors import Invalid

    try:
        return LengthBound(model, BASE_MODELS[model]["position_limit"], requested)
    except ValueError as e:
        raise Invalid(f"{param}: {e}", param=param, code="max_seq_len_too_large") from e


def tokenizer_for(folder: Path):
    """A model's tokenizer and chat template, from its folder in the store (the byte-level
    default when the folder has no tokenizer files, as for kiln-tiny)."""
    tok = load_tokenizer(folder)
    return tok, chat_template(tok)


def token_counter(model: str, folder: Path) -> Callable[[Example], tuple[int, int]]:
    """``folder``: the model's folder in the store (``store.model_dir(model, weights=False)``)."""
    tok, tpl = tokenizer_for(folder)
    image_tokens = BASE_MODELS[model]["image_tokens"]

    def count(ex: Example) -> tuple[int, int]:
        if ex.images and image_tokens is None:
            raise ValueError(f"{model} takes no image input")
        ids, target = encode_chat(tok, tpl, ex, image_tokens or 0)
        return len(ids), sum(target)

    return count
