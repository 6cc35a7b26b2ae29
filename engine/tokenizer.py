"""The embedded default tokenizer: bytes plus a few special tokens, and the chat template.

Template: each message is ``<|role|>`` + its UTF-8 bytes + ``<|end|>``; the loss covers an
assistant message's bytes and its ``<|end|>`` (when its weight is 1), nothing else.
Each ``<image>`` placeholder becomes ``image_tokens`` copies of ``<|image|>``.
"""
from __future__ import annotations

from kiln.dataset import IMAGE_TOKEN, Example

SPECIALS = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|image|>")


class ByteTokenizer:
    vocab_size = 256 + len(SPECIALS)

    def __init__(self) -> None:
        self.ids = {s: 256 + i for i, s in enumerate(SPECIALS)}
        self.pad_id, self.bos_id, self.end_id = self.ids["<|pad|>"], self.ids["<|bos|>"], self.ids["<|end|>"]
        self.image_id = self.ids["<|image|>"]

    def encode_text(self, text: str, image_tokens: int) -> list[int]:
        out: list[int] = []
        for k, piece in enumerate(text.split(IMAGE_TOKEN)):
            if k:
                out += [self.image_id] * image_tokens
            out += list(piece.encode("utf-8"))
        return out

    def encode_chat(self, ex: Example, image_tokens: int) -> tuple[list[int], list[bool]]:
        """Token ids and, per token, whether it is a training target."""
        ids, target = [self.bos_id], [False]
        for m in ex.messages:
            body = [self.ids[f"<|{m.role}|>"]] + self.encode_text(m.content, image_tokens) + [self.end_id]
            learn = m.role == "assistant" and m.weight == 1
            ids += body
            target += [False] + [learn] * (len(body) - 1)
        return ids, target

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
