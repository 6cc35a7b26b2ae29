"""Cheap activations remade in the backward instead of kept from the forward.

A producer whose output is cheap to make again from small or already-kept inputs (KDA's short
convolutions, from the projection output the convolution keeps anyway; a low-rank pair's second
projection, from the rank-wide first one) marks its output with ``remakeable``. A kernel's autograd
Function that saves its inputs through ``save`` then keeps the recipe, not the tensor, for each
marked one (or view of one), and ``saved`` makes it again, bit for bit, when the backward asks.
The forward's copy is freed as soon as the forward is done with it: at 8k tokens on Kimi Linear's
shapes, 64 MiB for each of a KDA layer's q, k, v, decay projection and output gate.

The recipe's tensors are saved with the Function's own (``save_for_backward``): freed with them
after the backward, and checked as they are for in-place changes. A marked tensor changed in place
after it was made is saved as it is.

Where saved-tensor hooks are active (Swap Core's recompute: ``torch.utils.checkpoint``), ``save``
saves as ``ctx.save_for_backward`` does, so the hooks see every tensor; a recipe would hold its
inputs outside them.

Only deterministic producers may be marked: the recipe runs again under the forward's autocast,
with no RNG state restored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

_MARK = "_kiln_remake"


@dataclass
class _Recipe:
    fn: Callable[..., torch.Tensor]
    args: tuple  # in a Function's ctx, its tensors are indices (_Saved) into the saved tensors
    cast: torch.dtype | None  # the forward's autocast dtype on the output's device (None: off)
    device: str
    layout: tuple  # the output's shape, stride and storage offset (in its base's storage)
    version: int  # the base's version when made: a later in-place change leaves it unmarked


def remakeable(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, marked so that ``save`` keeps ``fn`` and ``args`` in its place. Pass inputs
    that are small or kept anyway: they are held as long as the consumer's saved tensors are."""
    y = fn(*args)
    if torch.is_grad_enabled() and y.requires_grad:
        base = y if y._base is None else y._base  # a view's base (a LoRA projection returns one)
        device = y.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        layout = (y.shape, y.stride(), y.storage_offset())
        setattr(base, _MARK, _Recipe(fn, args, cast, device, layout, base._version))
    return y


def _recipe(t: torch.Tensor | None) -> _Recipe | None:
    if t is None:
        return None
    base = t if t._base is None else t._base
    r = getattr(base, _MARK, None)
    return r if r is not None and r.version == base._version else None


def save(ctx: Any, *tensors: torch.Tensor | None) -> None:
    """``ctx.save_for_backward(*tensors)``, with a recipe in place of each marked tensor (or view of
    one); ``saved(ctx)`` gives them back."""
    hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    plain: list[torch.Tensor | None] = list(tensors)
    ctx.remake = []
    for i, t in enumerate(tensors):
        r = None if hooked else _recipe(t)
        if r is None:
            continue
        assert t is not None
        args = []
        for a in r.args:  # a tensor argument becomes its index among the saved tensors
            if isinstance(a, torch.Tensor):
                plain.append(a)
                a = _Saved(len(plain) - 1)
            args.append(a)
        plain[i] = None
        view = (t.shape, t.stride(), t.storage_offset())
        ctx.remake.append((i, replace(r, args=tuple(args)), view))  # not r itself: it holds the tensors
    ctx.save_for_backward(*plain)
    ctx.saved_count = len(tensors)


@dataclass(frozen=True)
class _Saved:
    index: int


def saved(ctx: Any) -> tuple:
    """The tensors ``save`` was given, the marked ones made again."""
    every = ctx.saved_tensors
    tensors = list(every[: ctx.saved_count])
    for i, r, view in ctx.remake:
        args = tuple(every[a.index] if isinstance(a, _Saved) else a for a in r.args)
        with torch.no_grad(), torch.autocast(r.device, dtype=r.cast, enabled=r.cast is not None):
            y = r.fn(*args)
        if (y.shape, y.stride(), y.storage_offset()) != r.layout:
            raise RuntimeError(f"a remade activation came back as {tuple(y.shape)} / {y.stride()}, not {r.layout}")
        tensors[i] = y.as_strided(*view)
    return tuple(tensors)
