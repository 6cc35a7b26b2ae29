"""One base model served to many requests (``Batcher``): its weights loaded once, any number of
LoRA adapters beside them (``adapters.Adapters``), and one thread that decodes every running
request together (continuous batching: a new request joins at the next step; a finished one
frees its slots at once).

    b = Batcher(model_dir); b.add_adapter("ft:...", folder); b.start()
    ids, pixels = b.encode(example)          # the chat up to the open assistant turn
    for chunk in b.submit(ids, pixels, "ft:...", Sampling(max_tokens=64)):
        print(chunk.index, chunk.text, chunk.finish_reason)

On CUDA the model is bf16 throughout, as inference servers keep it (no autocast: its casts at
every matmul cost more host time than a decode step's small matmuls take), but for the few
parameters a rounding would move far: KDA's decay (``A_log``, ``dt_bias``) and the MoE router
(its weight and bias choose the experts); adapters in their base layer's dtype. On the CPU
everything stays as loaded (fp32).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch

from engine import device as accelerator
from engine.inference.adapters import Adapters, fuse
from engine.inference.decode import Chunk, Decoder, Prompt, Sampling, encode_prompt, pixels_of
from engine.model.registry import load_base, position_limit
from kiln.chat import MAX_N  # choices per request; a request's choices all fit in one batch
from kiln.dataset import Example
from kiln.tokenizer import chat_template, load_tokenizer

KEEP_FP32 = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")  # decay and routing


def to_bf16(model: torch.nn.Module) -> None:
    """Every floating tensor in bf16, but those named by ``KEEP_FP32``."""
    model.to(torch.bfloat16)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(KEEP_FP32):
            t.data = t.data.float()


class Handle:
    """A submitted request: iterate for its chunks (blocks; ends when every choice finished)."""

    def __init__(self, batcher: Batcher, prompt: Prompt):
        self._batcher, self.prompt = batcher, prompt
        self.prompt_tokens = len(prompt.ids)
        self.completion_tokens = 0
        self._chunks: queue.Queue[Chunk | Exception | None] = queue.Queue()
        self._open = prompt.sampling.n

    def _put(self, chunk: Chunk | Exception) -> None:
        self._chunks.put(chunk)

    def __iter__(self) -> Iterator[Chunk]:
        while self._open:
            c = self._chunks.get()
            if c is None:  # cancelled: no more chunks
                return
            if isinstance(c, Exception):
                raise c
            if c.finish_reason is not None:
                self._open -= 1
            yield c

    def cancel(self) -> None:
        """Stop the request: its slots are freed at the next step, and iterating ends."""
        self._batcher._cancel(self)
        self._chunks.put(None)


class Batcher:
    def __init__(
        self, model_dir: Path, device: str | torch.device | None = None, max_batch: int = 8, max_adapters: int = 32
    ):
        self.device = accelerator.resolve(device)
        model = load_base(Path(model_dir)).eval()
        model.to(self.device)
        if accelerator.accelerated(self.device):
            to_bf16(model)
        self.model = model
        self.tok = load_tokenizer(Path(model_dir))
        self.tpl = chat_template(self.tok)
        self.image_tokens: int | None = (
            getattr(model, "image_tokens", None) if getattr(model, "image_size", 0) else None
        )
        self.context_limit = position_limit(model)
        fuse(model)  # where it serves: the projections that read one input, one product
        self.adapters = Adapters(model)
        self.max_adapters = max_adapters
        self._recent: OrderedDict[str, None] = OrderedDict()  # the loaded adapters, least recently used first
        self.max_batch = max(max_batch, MAX_N)
        self.decoder = Decoder(model, self.tok, self.tpl, self.max_batch, self._emit)
        self._inbox: queue.Queue[Handle] = queue.Queue()
        self._cancelled: queue.Queue[Handle] = queue.Queue()
        self._lock = threading.RLock()  # adapters change between steps, never during one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: Counter[str] = Counter()  # requests of each adapter submitted, not started yet

    def add_adapter(self, name: str, folder: Path) -> None:
        """Load (or keep) the adapter in ``folder`` as ``name``; over ``max_adapters`` the least
        recently used ones that no request is using or waiting for are unloaded first."""
        with self._lock:
            self._add(name, folder)

    def _add(self, name: str, folder: Path) -> None:
        if name not in self.adapters.names:
            busy = self._in_use()
            idle = [a for a in self._recent if a not in busy]
            for old in idle[: max(0, len(self._recent) + 1 - self.max_adapters)]:
                self.adapters.remove(old)
                del self._recent[old]
            self.adapters.add(name, folder)
        self._recent[name] = None
        self._recent.move_to_end(name)

    def _in_use(self) -> set[str | None]:
        """The adapters of running requests and of those waiting to start (call under the lock)."""
        return {c.prompt.adapter for c in self.decoder.running} | {a for a, n in self._pending.items() if n}

    def encode(self, example: Example) -> tuple[list[int], torch.Tensor | None]:
        """The prompt's ids through the open assistant turn, and its images' pixels."""
        if not example.messages:
            raise ValueError("messages: at least one message is needed")
        if example.messages[-1].role == "assistant":
            raise ValueError("messages: the last message is the assistant's; the model answers a user or system turn")
        if example.images and not self.image_tokens:
            raise ValueError("this model takes no image input (text only)")
        ids = encode_prompt(self.tok, self.tpl, example.messages, self.image_tokens or 0)
        return ids, pixels_of(example.images, getattr(self.model, "image_size", 0))

    def submit(
        self,
        ids: list[int],
        pixels: torch.Tensor | None,
        adapter: str | None,
        sampling: Sampling,
        folder: Path | None = None,
    ) -> Handle:
        """Start a request; ``folder``: where ``adapter`` is, should it have been unloaded since it
        was added (it is loaded again)."""
        if not 1 <= sampling.n <= MAX_N:
            raise ValueError(f"n: {sampling.n} choices; between 1 and {MAX_N}")
        if sampling.max_tokens < 1:
            raise ValueError("max_tokens: at least 1")
        if self.context_limit is not None and len(ids) + sampling.max_tokens > self.context_limit:
            raise ValueError(
                f"max_tokens: the prompt's {len(ids)} tokens and max_tokens {sampling.max_tokens} exceed the"
                f" model's context of {self.context_limit} tokens"
            )
        h = Handle(self, Prompt(ids, pixels, adapter, sampling))
        h.prompt.emit = h
        with self._lock:  # loaded and queued at once: no other adapter's load unloads it in between
            if adapter is not None:
                if adapter not in self.adapters.names and folder is None:
                    raise ValueError(f"adapter {adapter} is not loaded")
                self._add(adapter, folder)  # type: ignore[arg-type]  # a loaded adapter needs no folder
                self._pending[adapter] += 1
            self._inbox.put(h)
        if self._thread is None:  # no loop thread: the caller's iteration drives nothing, so run one
            self.start()
        return h

    def _emit(self, prompt: Prompt, chunk: Chunk) -> None:
        h = prompt.emit
        assert isinstance(h, Handle)
        h.completion_tokens += chunk.tokens
        h._put(chunk)

    def _cancel(self, h: Handle) -> None:
        self._cancelled.put(h)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kiln-decode", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _started(self, handles: list[Handle]) -> None:
        """These requests left the queue (running now, or cancelled)."""
        with self._lock:  # (the lock is reentrant: the loop holds it already when admitting)
            for h in handles:
                if h.prompt.adapter is not None:
                    self._pending[h.prompt.adapter] -= 1

    def _loop(self) -> None:
        waiting: list[Handle] = []
        admit: list[Handle] = []
        while not self._stop.is_set():
            try:
                block = not waiting and not self.decoder.running
                waiting.append(self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait())
            except queue.Empty:
                pass
            while True:
                try:
                    h = self._cancelled.get_nowait()
                except queue.Empty:
                    break
                if any(w is h for w in waiting):
                    waiting = [w for w in waiting if w is not h]
                    self._started([h])
                self.decoder.cancel(h.prompt)
            try:
                with self._lock:
                    admit, free = [], len(self.decoder.free)
                    while waiting and waiting[0].prompt.sampling.n <= free:  # first come, first served
                        free -= waiting[0].prompt.sampling.n
                        admit.append(waiting.pop(0))
                    self._started(admit)
                    if admit:
                        self.decoder.prefill([h.prompt for h in admit])
                    else:
                        self.decoder.step()
            except Exception as e:  # a failed forward fails its requests, not the server
                for owner in {id(c.prompt): c.prompt.emit for c in self.decoder.running}.values():
                    assert isinstance(owner, Handle)
                    owner._put(e)
                for waiter in admit:
                    waiter._put(e)
                for c in list(self.decoder.running):
                    self.decoder.cancel(c.prompt)
