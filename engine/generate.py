"""Greedy decoding for evaluation: the answer a model gives to a chat's last user turn.

No KV cache (answers here are a few tokens; each new token re-runs the prefix): for
exact-match checks, not for serving.
"""

from __future__ import annotations

from typing import cast

import torch

from engine.data import image_tensor
from kiln.dataset import DatasetSource, Example, Message
from kiln.tokenizer import ChatTemplate, Tokenizer, encode_chat


@torch.no_grad()
def answer(
    model: torch.nn.Module,
    tok: Tokenizer,
    tpl: ChatTemplate,
    ex: Example,
    source: DatasetSource,
    max_new_tokens: int = 16,
) -> str:
    """Greedy continuation after the assistant header of the example's final assistant turn."""
    prompt = Example(ex.line, [m for m in ex.messages[:-1]] + [Message("assistant", "")], ex.images)
    ids, _ = encode_chat(tok, tpl, prompt, getattr(model, "image_tokens", None) or 0)
    ids = ids[: len(ids) - len(tpl.end)]  # drop the empty turn's end: generation starts here
    size = cast(int, model.image_size)
    pixels = torch.stack([image_tensor(source.read_image(r), size) for r in ex.images]) if ex.images else None
    out: list[int] = []
    was = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids + out]), pixels)
        nxt = int(logits[0, -1].argmax())
        if nxt in tpl.end:
            break
        out.append(nxt)
    model.train(was)
    return tok.decode(out)
