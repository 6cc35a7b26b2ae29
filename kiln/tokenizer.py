"""Tokenizers and chat templates, with no torch: shared by the API (token counts before a job
runs), the engine (training) and the CLI (local checks).

``load_tokenizer(model_dir)`` reads what a base model ships: ``tokenizer.json`` (Hugging Face
``tokenizers``), or a tiktoken-style ``tiktoken.model`` (one ``base64(token) rank`` a line, as
Kimi ships it) with special tokens from ``tokenizer_config.json``; without either it is the
byte-level default. ``chat_template(tok)`` picks the chat format from the special tokens the
tokenizer has (Kimi, DeepSeek, ChatML, or Kiln's own for the byte tokenizer), and
``encode_chat`` marks as training targets exactly the assistant tokens (and their end token)
of messages with weight 1.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kiln.dataset import IMAGE_TOKEN, Example

BYTE_SPECIALS = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|image|>")
# A split regex for tiktoken files that carry none (the GPT-4 one; Kimi's config names its own).
DEFAULT_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def special(self, token: str) -> int | None: ...


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus Kiln's special tokens: the embedded default."""

    vocab_size = 256 + len(BYTE_SPECIALS)

    def __init__(self) -> None:
        self._specials = {s: 256 + i for i, s in enumerate(BYTE_SPECIALS)}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def special(self, token: str) -> int | None:
        return self._specials.get(token)


class HFTokenizer:
    """A ``tokenizer.json``. Special tokens in the text are not parsed as specials: a dataset's
    text cannot inject control tokens."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _T

        self._t = _T.from_file(str(path))
        self._t.encode_special_tokens = True  # "<|im_end|>" typed in a dataset stays plain text
        self.vocab_size = self._t.get_vocab_size(with_added_tokens=True)
        self._added = {t.content for t in self._t.get_added_tokens_decoder().values()}

    def encode(self, text: str) -> list[int]:
        return self._t.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._t.decode(ids, skip_special_tokens=False)

    def special(self, token: str) -> int | None:
        return self._t.token_to_id(token) if token in self._added else None


class TiktokenTokenizer:
    """A tiktoken-style ranks file; special tokens from tokenizer_config.json's
    ``added_tokens_decoder`` (id -> content), numbered after the ranks."""

    def __init__(self, path: Path, config: dict):
        import tiktoken

        ranks = {}
        for line in path.read_bytes().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        specials = {v["content"]: int(k) for k, v in (config.get("added_tokens_decoder") or {}).items()}
        self._enc = tiktoken.Encoding(
            name=path.parent.name or "model",
            pat_str=config.get("pat_str", DEFAULT_PAT),
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._specials = specials
        self.vocab_size = max([*ranks.values(), *specials.values()]) + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())  # specials in text stay plain text

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def special(self, token: str) -> int | None:
        return self._specials.get(token)


def load_tokenizer(model_dir: Path | None) -> Tokenizer:
    if model_dir is not None:
        model_dir = Path(model_dir)
        if (model_dir / "tokenizer.json").exists():
            return HFTokenizer(model_dir / "tokenizer.json")
        if (model_dir / "tiktoken.model").exists():
            cfg = model_dir / "tokenizer_config.json"
            return TiktokenTokenizer(model_dir / "tiktoken.model", json.loads(cfg.read_text()) if cfg.exists() else {})
    return ByteTokenizer()


@dataclass
class ChatTemplate:
    name: str
    bos: list[int]
    start: dict[str, list[int]]  # tokens before a message's content, per role
    end: list[int]  # tokens after a message's content (learned after assistant turns)
    image_id: int | None
    pad_id: int


def chat_template(tok: Tokenizer) -> ChatTemplate:
    """The chat format the tokenizer's special tokens name. A tokenizer that has a family's marker
    token but lacks another token of that family's turns is a ValueError naming it (its id would
    otherwise be None inside every example)."""
    s = tok.special

    def need(family: str, token: str) -> int:
        i = s(token)
        if i is None:
            raise ValueError(f"the tokenizer looks like {family}'s but has no {token} token")
        return i

    pad = next((i for i in (s("<|pad|>"), s("<｜▁pad▁｜>"), s("[PAD]"), s("<|endoftext|>")) if i is not None), 0)
    if s("<|im_user|>") is not None and s("<|im_middle|>") is not None:  # Kimi
        mid = need("Kimi", "<|im_middle|>")
        start = {r: [need("Kimi", f"<|im_{r}|>"), *tok.encode(r), mid] for r in ("system", "user", "assistant")}
        return ChatTemplate("kimi", [], start, [need("Kimi", "<|im_end|>")], s("<|media_pad|>"), pad)
    if s("<｜User｜>") is not None:  # DeepSeek V3
        bos = s("<｜begin▁of▁sentence｜>")
        user, assistant = need("DeepSeek", "<｜User｜>"), need("DeepSeek", "<｜Assistant｜>")
        start = {"system": [], "user": [user], "assistant": [assistant]}
        end = [need("DeepSeek", "<｜end▁of▁sentence｜>")]
        return ChatTemplate("deepseek", [bos] if bos is not None else [], start, end, s("<｜image｜>"), pad)
    if s("<|im_start|>") is not None:  # ChatML
        start = {r: [need("ChatML", "<|im_start|>"), *tok.encode(f"{r}\n")] for r in ("system", "user", "assistant")}
        end = [need("ChatML", "<|im_end|>"), *tok.encode("\n")]
        return ChatTemplate("chatml", [], start, end, s("<|image_pad|>"), pad)
    if s("<|user|>") is not None:  # Kiln's byte tokenizer
        start = {r: [need("Kiln", f"<|{r}|>")] for r in ("system", "user", "assistant")}
        return ChatTemplate("kiln", [need("Kiln", "<|bos|>")], start, [need("Kiln", "<|end|>")], s("<|image|>"), pad)
    raise ValueError("the tokenizer has none of the chat tokens Kiln knows (Kimi, DeepSeek, ChatML)")


def encode_chat(tok: Tokenizer, tpl: ChatTemplate, ex: Example, image_tokens: int) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether it is a training target. Each ``<image>`` becomes
    ``image_tokens`` copies of the template's image token."""
    if ex.images and tpl.image_id is None:
        raise ValueError(f"the {tpl.name} tokenizer has no image token, but the example has images")
    image = tpl.image_id if tpl.image_id is not None else -1  # -1 never lands: no images, no placeholders
    ids, target = list(tpl.bos), [False] * len(tpl.bos)
    for m in ex.messages:
        body: list[int] = []
        for k, piece in enumerate(m.content.split(IMAGE_TOKEN)):
            if k:
                body += [image] * image_tokens
            body += tok.encode(piece)
        learn = m.role == "assistant" and m.weight == 1
        head = tpl.start[m.role]
        ids += head + body + tpl.end
        target += [False] * len(head) + [learn] * (len(body) + len(tpl.end))
    return ids, target
