"""Swap Core: activation recompute per block, with an op-level cache that keeps chosen outputs.

Blocks are the attention and MLP sublayers of every decoder layer (``model.layers[i].self_attn``,
``.mlp``), or only one kind of them (``blocks``: a kind left out keeps its activations, as without
recompute; which is worth it depends on its recompute time per byte kept). Each runs under
non-reentrant ``torch.utils.checkpoint``: its activations are dropped after the forward and
recomputed from the block's inputs in the backward.

- ``recompute: full``: the whole block is recomputed.
- ``recompute: selective``: the outputs of the chosen ops (``cache_ops``: matmuls, grouped GEMMs,
  the Triton kernels' forwards) are kept from the forward and handed back during the recompute,
  which then redoes only the cheap ops around them. Two ways in: aten op classes (``mm``, ...)
  through a dispatch mode that sees every op of the block (Python at every op, forward and
  recompute), and ``kernels`` (KDA, DSA's attention and indexer loss, the full attention's varlen
  kernels) at the kernel's own call (``kiln_kernels.dispatch.kept``: no cost for other ops). A
  kernel keeps all its backward saves but its inputs (KDA: o, the final state, A_qk,
  (I + A_kk)^-1; DSA: o, lse, the target), so its forward never runs twice: most recompute time
  per byte kept. ``projections`` keeps every LoRA projection's output the same way
  (``engine.lora.lora_linear``: base product, factors, scaling
  and sum in one Function, whose backward needs only its input and A x; a merged projection's
  base product through ``frozen_linear``), less recompute per byte kept than a kernel's: for the
  host tier, where bytes cost copy bandwidth, not device memory. ``experts`` keeps the grouped
  experts' output, gate/up product and rank-r LoRA products (kiln_kernels.moe.grouped's one Function for
  frozen expert weights, CUDA): the recompute runs none of their grouped GEMMs. Where a kept
  output lives is the ``tier``:
  ``device`` (device memory), ``host`` (pinned host memory: copied out on a side stream as the
  forward goes, one block late so that the forward's last block, the backward's first, stays
  on the device; brought back one block ahead of the backward, so copies overlap compute) or
  ``auto`` (device memory for the last ``device_budget_mb`` of each forward's kept outputs, as
  many as the forward before kept, and host memory before them).
- ``quantize``: 16-bit outputs (bf16 under autocast) are kept in one byte an element with an
  fp32 scale per block of 32 along the last dim (per row when it does not divide): ``fp8``
  (float8 e4m3) or ``int8`` (absmax). 1.125 bytes an element instead of 2. fp32 outputs (router
  scores, computed in fp32 on purpose) stay exact. e4m3 keeps 3 mantissa bits whatever the
  scale; int8 uses the narrow range inside a block, so int8 is the precise one. Either adds
  little to what bf16 autocast itself moves the gradients from fp32. The kernels' outputs are
  never quantized (they are few bytes for their cost, and a kernel's backward takes them as they
  were).
- Selections (``SELECTIONS``: DSA's top-k) are kept whenever anything is, whatever ``cache_ops``
  says: the recompute must choose what the forward chose, and from quantized kept values it might
  not.

Unquantized, the gradients are bit-equal to a run without recompute: a kept value is the
forward's own value, and every other op is recomputed deterministically with the forward's RNG
state. The recompute must run the kept ops in the forward's order; if it does not (a block whose
control flow depends on global state), training stops with an error rather than use wrong data.

Measured (step time, peak memory and gradient error of each mode; the quantized caches' error):
see bench/RESULTS.md, the Swap Core sections (the latest: "Swap Core with the norms in Triton")
and "Numbers that lived in module docstrings".

Legend: N rows (all dims but the last), C the last dim.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from engine import device as accelerator
from engine.model.common import recompute
from kiln.spec import MemorySpec
from kiln_kernels.dispatch import keeping

aten = torch.ops.aten
# The op classes a config may name; a class covers the aten ops that compute it.
OP_CLASSES: dict[str, tuple[str, ...]] = {
    "mm": ("mm", "addmm"),  # nn.Linear and every 2-D matmul (3-D inputs fold to 2-D)
    "bmm": ("bmm", "baddbmm"),  # batched matmuls (attention scores, einsum contractions)
    "grouped_mm": ("_grouped_mm",),  # torch's grouped GEMM for experts (torch >= 2.8)
    "attention": (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ),
}
# Op classes kept at the call (kiln_kernels.dispatch.kept names): the Triton kernels' forwards. On a
# CPU the references run instead, plain torch ops: nothing of this class is kept there.
CALLS: dict[str, tuple[str, ...]] = {
    "kernels": ("kda", "sparse_attention", "attention"),
    "attention": ("attention",),  # kiln_kernels.attention's varlen kernels
    "projections": ("projection",),  # LoRA projections' outputs
    "experts": ("experts",),
}  # frozen grouped experts with LoRA
# Discrete choices: kept whenever anything is (a few bytes a token), so that the recompute repeats
# the forward's choice exactly. Recomputed from quantized kept values they could differ, and the
# backward would differentiate another forward (DSA's top-k: 0.022 -> 0.006 gradient error with
# int8 caches, measured on the CPU hybrid); kept, the recompute also skips the indexer's scores.
SELECTIONS = frozenset({"indexer_topk"})
BLOCKS = {"attention": "self_attn", "mlp": "mlp"}  # memory.blocks -> the decoder layer's sublayer
QUANT = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}  # code dtype, largest code
BLOCK = 32  # elements per quantization scale


def resolve_ops(names: Sequence[str]) -> tuple[frozenset, frozenset]:
    """(aten op packets, kept call names) for the op classes named; a class whose ops this torch
    lacks adds none."""
    unknown = sorted(set(names) - set(OP_CLASSES) - set(CALLS))
    if unknown:
        raise ValueError(
            f"memory.cache_ops: unknown op class(es) {', '.join(unknown)}; known: {', '.join([*OP_CLASSES, *CALLS])}"
        )
    ops = frozenset(getattr(aten, op) for n in names for op in OP_CLASSES.get(n, ()) if hasattr(aten, op))
    return ops, frozenset(c for n in names for c in CALLS.get(n, ()))


@dataclass
class _Kept:
    """One kept tensor: where it is, and how to make the original back."""

    data: torch.Tensor  # the value, or its codes [N, b]; on the device or in host memory
    scale_N1: torch.Tensor | None  # quantized: one fp32 scale per block of b
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    tier: str  # "device" | "host"
    nbytes: int
    version: int
    alias: torch.Tensor | None = None  # the forward's tensor, until the block's forward ends (in-place check)


@dataclass(eq=False)
class _Frame:
    """What one block's forward kept, in op order, and the state of its copies back."""

    kept: dict[Any, deque] = field(default_factory=lambda: defaultdict(deque))
    fetched: bool = False
    ready: Any = None  # the device's event, set when the copies back to the device are done

    def leaves(self) -> Iterator[_Kept]:
        """Every kept tensor not yet handed back."""
        for q in self.kept.values():
            for item in q:
                yield from _leaves(item)


class SwapCore:
    """The cache and the copy stream for one model; ``wrap`` makes a module a recomputed block."""

    def __init__(self, spec: MemorySpec):
        self.spec = spec
        ops, calls = resolve_ops(spec.cache_ops)
        selective = spec.recompute == "selective"
        self.ops = ops if selective else frozenset()  # aten ops, through a dispatch mode
        self.calls = calls | SELECTIONS if selective else frozenset()  # kiln_kernels.dispatch.kept names
        self.budget = (spec.device_budget_mb or 0.0) * 2**20
        self.frames: list[weakref.ref] = []  # blocks of the forward not yet recomputed, in order
        self.live = {"device": 0, "host": 0}  # bytes kept now
        self.peak = {"device": 0, "host": 0}  # the most kept at once since reset_peaks()
        self._stream: Any = None  # the side stream of the device the kept tensors are on
        self.outgoing: list[_Kept] = []  # host-tier outputs of the latest block, still on the device
        self.sent = 0  # bytes kept so far in this forward
        self.per_forward: int | None = None  # bytes the last whole forward kept (tier auto's plan)
        self.backward = False  # a backward has begun since the last forward

    # -- the blocks -------------------------------------------------------------------------
    def wrap(self, module: nn.Module) -> None:
        """Recompute ``module`` in the backward. The forward is replaced on the instance only, so
        parameter names (and adapters) stay as they are."""
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not (torch.is_grad_enabled() and module.training):
                return inner(*args, **kwargs)  # evaluation: nothing to keep
            # No early stop: the recompute runs the whole block, so a recompute that takes another
            # path than the forward is caught (by the kept ops' order and torch's own count of saved
            # tensors) instead of handing the backward another tensor of the same shape.
            with set_checkpoint_early_stop(False):
                return checkpoint(inner, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

        module.forward = forward

    def _contexts(self):
        if not self.calls:  # full recompute: nothing to keep, only the recompute flag
            return nullcontext(), recompute.flagged()
        if self.backward:  # a new forward: the one before kept this many bytes
            self.per_forward, self.sent, self.backward = self.sent, 0, False
        self.send_out()
        frame = _Frame()
        self.frames.append(weakref.ref(frame))
        return _Keep(self, frame), _Reuse(self, frame)

    def reset_peaks(self) -> None:
        self.peak = dict(self.live)

    # -- keeping and giving back --------------------------------------------------------------
    def stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = accelerator.module(device).Stream(device)
        return self._stream

    def _count(self, tier: str, nbytes: int) -> None:
        self.live[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.live[tier])

    def _tier(self, nbytes: int) -> str:
        """``auto``: the device for the forward's last ``budget`` bytes (as many as the forward before
        kept; the first forward fills the device first), the host before them. The last blocks are
        the backward's first: they would have no time to go out and come back, while the first
        ones' copies overlap the rest of the forward and come back ahead of their recompute."""
        if self.spec.tier != "auto":
            return self.spec.tier
        if self.live["device"] + nbytes > self.budget:
            return "host"
        late = self.per_forward is None or self.sent >= self.per_forward - self.budget
        return "device" if late else "host"

    def keep(self, x: torch.Tensor, exact: bool = False) -> _Kept:
        """Store a forward output (called inside the op dispatch or a kernel's forward: no autograd
        here); quantized as ``spec.quantize`` says unless ``exact``."""
        data, scale = x.detach(), None
        if (
            not exact
            and self.spec.quantize != "none"
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim()
            and x.numel()
        ):
            data, scale = quantize(data, self.spec.quantize)
        nbytes = data.numel() * data.element_size() + (scale.numel() * 4 if scale is not None else 0)
        tier = self._tier(nbytes)
        self.sent += nbytes
        self._count(tier, nbytes)
        k = _Kept(data, scale, x.shape, x.dtype, x.device, tier, nbytes, x._version, alias=x)
        if tier == "host" and accelerator.accelerated(x.device):
            self.outgoing.append(k)  # copied out when the next block starts (see send_out)
        return k

    def send_out(self) -> None:
        """Start the host copies of what the blocks before kept. One block late: the last block of
        the forward is the first one the backward recomputes, and its outputs never leave the
        device (copied out and back, they would stall the backward's start)."""
        for k in self.outgoing:
            k.data = self._to_host(k.data)
            if k.scale_N1 is not None:
                k.scale_N1 = self._to_host(k.scale_N1)
        self.outgoing.clear()

    def begin_backward(self) -> None:
        """A block's recompute starts: the latest block's outputs stay on the device, and the next
        forward starts a new count of bytes kept (tier auto's plan)."""
        self.outgoing.clear()
        self.backward = True

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy, made on the side stream after the compute that wrote ``t``."""
        on = accelerator.module(t.device)
        s = self.stream(t.device)
        s.wait_stream(on.current_stream(t.device))
        with on.stream(s):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(s)  # the device memory is reused only after the copy
        return host

    def fetch(self, frame: _Frame) -> None:
        """Start bringing a block's host-kept tensors back to the device (on the side stream)."""
        if frame.fetched:
            return
        frame.fetched = True
        todo = [k for k in frame.leaves() if k.tier == "host" and k.data.device != k.device]
        if not todo:
            return
        device = todo[0].device
        on = accelerator.module(device)
        s = self.stream(device)  # the copies out were queued on this stream too: they come first
        with on.stream(s):
            for k in todo:
                k.data = k.data.to(k.device, non_blocking=True)
                k.version = k.data._version  # a new tensor: the in-place check starts from its count
                if k.scale_N1 is not None:
                    k.scale_N1 = k.scale_N1.to(k.device, non_blocking=True)
            frame.ready = on.Event()
            frame.ready.record(s)
        for k in todo:  # used and freed on the compute stream
            k.data.record_stream(on.current_stream(device))
            if k.scale_N1 is not None:
                k.scale_N1.record_stream(on.current_stream(device))

    def give_back(self, k: _Kept) -> torch.Tensor:
        """The kept output as the recompute's op returns it."""
        self.live[k.tier] -= k.nbytes
        if k.alias is not None or (k.scale_N1 is None and k.data.device == k.device and k.data._version != k.version):
            raise RuntimeError("Swap Core: a kept output was changed in place after its block's forward")
        data = k.data if k.data.device == k.device else k.data.to(k.device)
        if k.scale_N1 is None:
            return data
        return (data.to(torch.float32) * k.scale_N1.to(data.device)).to(k.dtype).view(k.shape)

    def next_to_recompute(self, frame: _Frame) -> _Frame | None:
        """The block the backward will recompute after ``frame``: the one before it in the forward."""
        alive = [f for f in (r() for r in self.frames) if f is not None]
        self.frames = [weakref.ref(f) for f in alive]
        i = next((j for j, f in enumerate(alive) if f is frame), None)
        return alive[i - 1] if i else None

    def forget(self, frame: _Frame) -> None:
        for k in frame.leaves():
            self.live[k.tier] -= k.nbytes
        frame.kept.clear()
        self.frames = [r for r in self.frames if r() is not None and r() is not frame]


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One byte an element: codes [N, b] and fp32 scales [N, 1] for blocks of b = 32 along the
    last dim (the whole last dim when 32 does not divide it)."""
    code, top = QUANT[kind]
    b = BLOCK if x.shape[-1] % BLOCK == 0 else x.shape[-1]
    blocks = x.reshape(-1, b).float()
    scale_N1 = (blocks.abs().amax(-1, keepdim=True) / top).clamp_min(1e-30)
    scaled = blocks / scale_N1
    return (scaled.round() if code == torch.int8 else scaled).to(code), scale_N1


def _leaves(item) -> Iterator[_Kept]:
    if isinstance(item, _Kept):
        yield item
    elif isinstance(item, (tuple, list)):
        for x in item:
            yield from _leaves(x)


class _Phase:
    """One block's forward (``_Keep``) or its recompute (``_Reuse``): the hook at the kernels'
    calls, and a dispatch mode for the aten op classes when any is chosen. ``op(key, run, exact)``
    is what each does with a chosen op."""

    def __init__(self, core: SwapCore, frame: _Frame):
        self.core, self.frame = core, frame
        self._entered = ExitStack()  # the hook, and the dispatch mode if any
        self.inside = False  # in a kept call's own work: the dispatch mode keeps none of its ops

    def op(self, key, run, exact: bool):
        raise NotImplementedError

    def call(self, name: str, run):
        if name not in self.core.calls:
            return run()

        def whole():  # the recompute hands the call back whole: its ops, kept apart, would be left over
            before, self.inside = self.inside, True
            try:
                return run()
            finally:
                self.inside = before

        return self.op(name, whole, exact=True)

    def __enter__(self):
        self._entered.enter_context(keeping(self.call))
        if self.core.ops:
            self._entered.enter_context(_Ops(self))
        return self

    def __exit__(self, *exc):
        self._entered.close()


class _Ops(TorchDispatchMode):
    """Every aten op of a block passes here; the chosen ones go to the phase."""

    def __init__(self, phase: _Phase):
        super().__init__()
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase.inside or func.overloadpacket not in self.phase.core.ops:  # most ops: straight through
            return func(*args, **kwargs)
        return self.phase.op(func, lambda: func(*args, **kwargs), exact=False)


class _Keep(_Phase):
    """The block's forward: run every op, keep the outputs of the chosen ones."""

    def op(self, key, run, exact: bool):
        out = run()
        self.frame.kept[key].append(tree_map_only(torch.Tensor, functools.partial(self.core.keep, exact=exact), out))
        return out

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for k in self.frame.leaves():  # an output changed in place later in the block would be stale
            if k.alias is not None and k.alias._version != k.version:
                raise RuntimeError(
                    "Swap Core: an op changed a kept output in place; recompute that block "
                    "fully or take the op's class out of memory.cache_ops"
                )
            k.alias = None  # a host copy holds the device memory only until it is done


class _Reuse(_Phase):
    """The block's recompute: the chosen ops return what the forward kept, the rest run again."""

    def __enter__(self):
        if self.frame.kept is None:
            raise RuntimeError("Swap Core: a block was recomputed twice (a second backward through one graph)")
        recompute.begin()
        self.core.begin_backward()
        self.core.fetch(self.frame)
        nxt = self.core.next_to_recompute(self.frame)
        if nxt is not None:
            self.core.fetch(nxt)  # the next block's copies overlap this block's compute
        if self.frame.ready is not None:
            self.frame.ready.wait()  # the compute stream waits for the copies back
        return super().__enter__()

    def __exit__(self, *exc):
        recompute.end()
        left = sum(len(q) for q in self.frame.kept.values())
        self.core.forget(self.frame)
        self.frame.kept = None  # type: ignore[assignment]
        super().__exit__(*exc)
        if left and exc[0] is None:
            raise RuntimeError(
                f"Swap Core: the recompute ran {left} kept op(s) fewer than the forward did; "
                "the block's control flow changed between forward and backward"
            )

    def op(self, key, run, exact: bool):
        q = self.frame.kept.get(key)
        if not q:
            raise RuntimeError(
                f"Swap Core: the recompute ran {key} more often than the forward did; the "
                "block's control flow changed between forward and backward"
            )
        return tree_map_only(_Kept, self.core.give_back, q.popleft())


def apply_swap_core(model: nn.Module, spec: MemorySpec) -> SwapCore | None:
    """Make every decoder layer's attention and / or MLP (``spec.blocks``) a recomputed block, as
    ``spec`` says."""
    core = SwapCore(spec)  # validates the spec
    if spec.recompute == "none":
        return None
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"memory.recompute: {type(model).__name__} has no decoder layers to recompute")
    for layer in layers:
        for kind, name in BLOCKS.items():
            if kind in spec.blocks:  # once each, however often the list names it
                core.wrap(getattr(layer, name))
    return core
