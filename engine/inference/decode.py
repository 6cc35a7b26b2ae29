"""Incremental decoding of many sequences at once over one model (``Decoder``): a prompt's tokens
go through the model once (``prefill``, every new prompt of a batch as one row of documents), then
each ``step`` feeds every running sequence its last token, one document each, and samples the
next. The layers keep what the next tokens need in a ``cache.Cache``; the output equals a fresh
forward of the whole sequence (tests/unit/test_decode.py).

A prompt asks for ``n`` choices: one prefill, its state copied to n slots. Sampling per choice:
temperature (0: greedy), top-p, its own generator (``seed`` + choice index: the same request
gives the same text), stop strings (cut before them) and the end of the assistant's turn (the
chat template's end token), at most ``max_tokens``. Text comes out as it is decided: a piece that
may still become a stop string, or an unfinished UTF-8 character, is held back.

Legend: N sequences of a step, L prompt tokens of a prefill, V vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from engine import device as accelerator
from engine.data import image_tensor
from engine.inference.adapters import Routing, routes
from engine.inference.cache import Cache
from kiln.dataset import Example, Message, decode_data_url
from kiln.tokenizer import ChatTemplate, Tokenizer, encode_chat
from kiln_kernels.widths import wide


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1


@dataclass
class Chunk:
    """New text of choice ``index``; ``finish_reason`` "stop" or "length" on its last chunk."""

    index: int
    text: str
    finish_reason: str | None = None
    tokens: int = 0  # on the last chunk: the tokens the choice sampled (its end token counted)


@dataclass
class Prompt:
    ids: list[int]
    pixels: torch.Tensor | None  # [images, 3, size, size]
    adapter: str | None
    sampling: Sampling
    emit: object = None  # the caller's: called with each Chunk (see Decoder)


@dataclass
class Choice:
    prompt: Prompt
    index: int
    slot: int
    generator: torch.Generator
    ids: list[int] = field(default_factory=list)  # sampled, the end token included
    sent: int = 0  # characters of the text emitted
    finish: str | None = None
    # the text of ids[:read], settled (no unfinished character), and where the next decode
    # starts: one settled piece back, whose text anchors the new tokens' (a piece's leading
    # space, a character split over tokens)
    text: str = ""
    prefix: int = 0
    read: int = 0


def encode_prompt(tok: Tokenizer, tpl: ChatTemplate, messages: list[Message], image_tokens: int) -> list[int]:
    """The chat's tokens through the open assistant header: where the answer begins."""
    ids, _ = encode_chat(tok, tpl, Example(0, [*messages, Message("assistant", "")], []), image_tokens)
    return ids[: len(ids) - len(tpl.end)]


def pixels_of(refs: list[str], size: int) -> torch.Tensor | None:
    """The images of a prompt ([N, 3, size, size]) from their data: URLs."""
    if not refs:
        return None
    for r in refs:
        if not r.startswith("data:"):
            raise ValueError(f"an image must be a data: URL here, got {r[:40]!r}")
    return torch.stack([image_tensor(decode_data_url(r), size) for r in refs])


class Decoder:
    """``slots`` sequences at most in flight on ``model`` (a family's CausalLM, its adapters served
    by ``engine.inference.adapters`` or its own LoRA layers). ``emit(prompt, chunk)`` hears every
    piece of text."""

    def __init__(self, model: nn.Module, tok: Tokenizer, tpl: ChatTemplate, slots: int, emit=None):
        self.model: Any = model  # a family's CausalLM: ``hidden`` and ``lm_head``
        self.tok, self.tpl, self.emit = tok, tpl, emit
        self.device = next(model.parameters()).device
        # bf16 autocast on an accelerator where some matmul weight is wider (a training model: its
        # fp32 LoRA factors and master weights); a model kept in bf16 runs as it is
        self.autocast = accelerator.accelerated(self.device) and any(
            m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, nn.Linear)
        )
        self.cache = Cache(slots, self.device)
        self.width = 0  # the hidden width, known after the first forward
        self.free = list(range(slots))
        self.running: list[Choice] = []
        self.ends = {tpl.end[0]}
        # never drawn: the image placeholder (it stands for pixels the answer does not have)
        self.banned = torch.tensor([t for t in (tpl.image_id,) if t is not None], dtype=torch.long, device=self.device)

    def _forward(self, ids: list[list[int]], slots: list[int], adapters: list[str | None], pixels) -> torch.Tensor:
        """The next tokens ``ids[d]`` of the sequences in ``slots``: the last position's logits of
        each [N, V] fp32."""
        new = [len(i) for i in ids]
        at = self.cache.begin(slots, new)
        cu = list(accumulate(new, initial=0))  # the documents' offsets
        L = cu[-1]
        # one tensor made and one copy to the device (each is a wait for the device)
        both = torch.tensor([t for i in ids for t in i] + at + [e - 1 for e in cu[1:]]).to(self.device)
        flat, positions, last = both[:L][None], both[L : 2 * L][None], both[2 * L :]
        # the documents stay on the host: the layers read their offsets there
        docs = torch.tensor([d for d, n in enumerate(new) for _ in range(n)])[None]
        routing = Routing(adapters, cu)
        with accelerator.autocast(self.device, self.autocast), routes(routing):
            h = self.model.hidden(flat, pixels, docs, positions, self.cache)
        self.width = h.shape[-1]  # the model's hidden width, for ``one_thread``
        with accelerator.autocast(self.device, self.autocast):
            logits = self.model.lm_head(h[0, last])
        self.cache.advance()
        return wide(logits)

    @torch.inference_mode()
    def prefill(self, prompts: list[Prompt]) -> None:
        """Start ``prompts`` (each ``fits``), one forward for all, ordered by adapter."""
        prompts = sorted(prompts, key=lambda p: p.adapter or "")
        firsts, choices = [], []
        for p in prompts:
            slots = [self.free.pop(0) for _ in range(p.sampling.n)]
            firsts.append(slots[0])
            seed = p.sampling.seed if p.sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
            for i, s in enumerate(slots):
                g = torch.Generator(self.device).manual_seed(seed + 1_000_003 * i)
                choices.append(Choice(p, i, s, g))
        images = [p.pixels for p in prompts if p.pixels is not None]
        pixels = torch.cat(images).to(self.device) if images else None
        logits = self._forward([p.ids for p in prompts], firsts, [p.adapter for p in prompts], pixels)
        rows = []
        for k, p in enumerate(prompts):
            own = [c for c in choices if c.prompt is p]
            self.cache.copy(firsts[k], [c.slot for c in own[1:]])
            rows += [k] * len(own)
        self._take(choices, logits[torch.tensor(rows, device=self.device)])
        self.running += [c for c in choices if c.finish is None]
        self.running.sort(key=lambda c: c.prompt.adapter or "")

    @torch.inference_mode()
    def step(self) -> None:
        """One token for every running choice (on the CPU a small step in one intra-op thread:
        ``one_thread``)."""
        if not self.running:
            return
        run = self.running
        with one_thread(self.device, len(run) * self.width):
            logits = self._forward(
                [[c.ids[-1]] for c in run], [c.slot for c in run], [c.prompt.adapter for c in run], None
            )
        self._take(run, logits)
        self.running = [c for c in run if c.finish is None]

    @torch.inference_mode()
    def cancel(self, prompt: Prompt) -> None:
        for c in [c for c in self.running if c.prompt is prompt]:
            self._finish(c, None)
        self.running = [c for c in self.running if c.prompt is not prompt]

    def _take(self, choices: list[Choice], logits: torch.Tensor) -> None:
        """Sample each choice's next token from its row of ``logits`` and emit what it decides."""
        if len(self.banned):
            logits = logits.index_fill(1, self.banned, float("-inf"))
        for c, t in zip(choices, sample(logits, choices), strict=True):
            c.ids.append(t)
            limit = len(c.ids) >= c.prompt.sampling.max_tokens
            if t in self.ends:
                self._text(c, c.ids[:-1], "stop")
            else:
                self._text(c, c.ids, "length" if limit else None)

    def _decoded(self, c: Choice, ids: list[int]) -> str:
        """The text of ``ids`` (c's tokens, or all but its end token), decoding only from
        ``c.prefix`` on: a step costs the same at the 4,000th token as at the first. Where the
        tokenizer's text of the later tokens does not extend that of the earlier (a ByteFallback
        decoder joins byte tokens across the two: an invalid run), the whole, settled as well."""
        head, tail = self.tok.decode(ids[c.prefix : c.read]), self.tok.decode(ids[c.prefix :])
        whole = tail.startswith(head)
        text = c.text + tail[len(head) :] if whole else self.tok.decode(ids)
        if not text.endswith("\ufffd"):  # settled: the next step decodes from these tokens on
            c.text, c.prefix, c.read = text, c.read, len(ids)
        return text

    def _text(self, c: Choice, ids: list[int], finish: str | None) -> None:
        text = self._decoded(c, ids)
        stops = c.prompt.sampling.stop
        cut = min((i for i in (text.find(s, max(0, c.sent - len(s))) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        end = len(text)
        if finish is None:  # hold back what may yet change: an unfinished character, a stop string's start
            end = len(text.rstrip("\ufffd"))
            for s in stops:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        piece = text[c.sent : max(end, c.sent)]
        c.sent = max(end, c.sent)
        if finish is not None:
            self._finish(c, finish, piece)
        elif piece and self.emit is not None:
            self.emit(c.prompt, Chunk(c.index, piece))

    def _finish(self, c: Choice, reason: str | None, piece: str = "") -> None:
        c.finish = reason or "cancelled"
        self.cache.free(c.slot)
        self.free.append(c.slot)
        if reason is not None and self.emit is not None:
            self.emit(c.prompt, Chunk(c.index, piece, reason, len(c.ids)))


SMALL_STEP = 1024  # a decode step's rows x hidden width under which the CPU runs it in one thread


@contextmanager
def one_thread(device: torch.device, rows_x_width: int) -> Iterator[None]:
    """On the CPU, where ``rows_x_width`` is under SMALL_STEP, the block's ops in this thread
    alone, the thread count given back after: such a step's ops are too small to share out, and
    a second thread costs each one its wait. On a 2-core VM, a step of 8 rows took (one / two
    threads) 2.1 / 2.6 ms at width 64, the same at 128, 3.3 / 3.0 at 192, 55 / 48 at 1024
    (bench/RESULTS.md). Torch keeps the count per thread: a server's other running threads keep
    theirs. Elsewhere nothing changes."""
    threads = torch.get_num_threads() if device.type == "cpu" and rows_x_width < SMALL_STEP else 1
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sample(logits: torch.Tensor, choices: list[Choice]) -> list[int]:
    """One token per row: argmax where the temperature is 0, else a draw from the softmax at that
    temperature cut to its top-p mass, by the exponential race (argmax of p / Exp(1) noise: a
    draw from p) on the choice's own generator. One read back for all rows."""
    picks = logits.argmax(-1)  # every row's greedy choice, kept for the rows at temperature 0
    drawn = [i for i, c in enumerate(choices) if c.prompt.sampling.temperature != 0]
    if not drawn:
        return picks.tolist()
    temps = torch.tensor([c.prompt.sampling.temperature or 1.0 for c in choices], device=logits.device)
    top_p = torch.tensor([c.prompt.sampling.top_p for c in choices], device=logits.device)
    probs = (logits / temps[:, None]).softmax(-1)
    if bool((top_p < 1).any()):
        p, order = probs.sort(-1, descending=True)
        p = p.masked_fill(p.cumsum(-1) - p > top_p[:, None], 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, p)
    for i in drawn:
        noise = torch.empty_like(probs[i]).exponential_(generator=choices[i].generator)
        picks[i] = (probs[i] / noise).argmax()
    return picks.tolist()
