"""Cheap activations remade in the backward instead of kept from the forward.

A producer whose output is cheap to make again from small or already-kept inputs (KDA's short
convolutions, from the projection output the convolution keeps anyway; a low-rank pair's second
projection, from the rank-wide first one) marks its output with ``remakeable``. A kernel's autograd
Function that saves its inputs through ``save`` then keeps the recipe, not the tensor, for each
marked one, and ``saved`` makes it again, bit for bit, when the backward asks. The forward's copy
is freed as soon as the forward is done with it: at 8k tokens on Kimi Linear's shapes, 64 MiB for
each of a KDA layer's q, k, v, decay projection and output gate.

Where saved-tensor hooks are active (Swap Core's recompute: ``torch.utils.checkpoint``), ``save``
saves as ``ctx.save_for_backward`` does, so the hooks see every tensor; a recipe would hold its
inputs outside them.

Only deterministic producers may be marked: the recipe runs again under the forward's autocast,
with no RNG state restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_RECIPE = "_kiln_remake"


def remakeable(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, marked so that ``save`` keeps ``fn`` and ``args`` in its place. The args are
    held as long as a consumer's recipe is: pass inputs that are small or kept anyway."""
    y = fn(*args)
    if torch.is_grad_enabled() and y.requires_grad:
        device = y.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        setattr(y, _RECIPE, (fn, args, cast, y.shape, y.stride()))
    return y


def _recipe(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    base = t if t._base is None else t._base
    return getattr(base, _RECIPE, None)


def save(ctx: Any, *tensors: torch.Tensor | None) -> None:
    """``ctx.save_for_backward(*tensors)``, with a recipe in place of each marked tensor (or view of
    one); ``saved(ctx)`` gives them back."""
    hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    recipes = {} if hooked else {i: r for i, t in enumerate(tensors) if (r := _recipe(t)) is not None}
    for i in recipes:
        t = tensors[i]
        assert t is not None
        recipes[i] = (recipes[i], t.shape, t.stride(), t.storage_offset())
    ctx.save_for_backward(*(None if i in recipes else t for i, t in enumerate(tensors)))
    ctx.remake = recipes


def saved(ctx: Any) -> tuple:
    """The tensors ``save`` was given, the marked ones made again."""
    tensors = list(ctx.saved_tensors)
    for i, ((fn, args, cast, shape, stride), *view) in ctx.remake.items():
        device = args[0].device.type
        with torch.no_grad(), torch.autocast(device, dtype=cast, enabled=cast is not None):
            y = fn(*args)
        if y.shape != shape or y.stride() != stride:
            raise RuntimeError(f"a remade activation came back {tuple(y.shape)} / {y.stride()}, not {shape} / {stride}")
        tensors[i] = y.as_strided(*view)
    return tuple(tensors)
