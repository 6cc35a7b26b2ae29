"""``kiln_kernels.remake`` on the CPU: an autograd Function that saves through ``save`` gets a
marked input (or a view of one) made again by ``saved``, in the forward's autocast dtype, and
frees the forward's copy; unmarked tensors and None pass as ``save_for_backward`` keeps them."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from engine.model.common.kda import low_rank
from kiln_kernels.remake import remakeable, save, saved


class Scale(torch.autograd.Function):
    """y = x * s; dx = dy * s, ds = sum(dy * x): the backward reads x and s, saved through ``save``."""

    @staticmethod
    def forward(ctx, x, s):
        save(ctx, x, None, s)
        return x * s

    @staticmethod
    def backward(ctx, dy):
        x, none, s = saved(ctx)
        assert none is None
        return dy * s, (dy * x).sum()


def test_a_marked_view_is_remade_and_the_original_freed():
    calls = []

    def make(a):
        calls.append(1)
        return (a * 2).exp()

    a = torch.randn(4, 6, requires_grad=True)
    s = torch.tensor(1.5, requires_grad=True)
    y = remakeable(make, a)
    ref = weakref.ref(y)
    out = Scale.apply(y.view(2, 12)[:, 3:9], s)
    del y
    gc.collect()
    assert ref() is None  # nothing keeps the forward's copy
    out.sum().backward()
    assert len(calls) == 2  # the forward, then once in the backward
    a2, s2 = a.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    ((a2 * 2).exp().view(2, 12)[:, 3:9] * s2).sum().backward()  # plain autograd, everything kept
    assert torch.equal(a.grad, a2.grad) and torch.equal(s.grad, s2.grad)


def test_a_recipe_runs_again_under_the_forwards_autocast():
    dtypes = []
    lin = nn.Linear(8, 8)

    def project(a):
        y = lin(a)
        dtypes.append(y.dtype)
        return y

    a = torch.randn(3, 8, requires_grad=True)
    s = torch.tensor(2.0, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = remakeable(project, a)
        out = Scale.apply(y, s.to(torch.bfloat16))
    out.float().sum().backward()  # the backward outside autocast: the recipe re-enters it
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_outside_autograd_nothing_is_marked():
    with torch.no_grad():
        y = remakeable(torch.exp, torch.randn(3, requires_grad=True))
    assert not hasattr(y, "_kiln_remake")
    y = remakeable(torch.exp, torch.randn(3))  # no gradient asked: nothing will save it
    assert not hasattr(y, "_kiln_remake")


class Dropped(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.lin, self.dropout = nn.Linear(4, 4), nn.Dropout(p) if p else nn.Identity()

    def forward(self, a):
        return self.lin(self.dropout(a))


def test_a_low_rank_projection_drawing_dropout_is_kept():
    a = torch.randn(2, 4, requires_grad=True)
    assert not hasattr(low_rank(Dropped(0.1).train(), a), "_kiln_remake")  # its draw would not come back
    assert hasattr(low_rank(Dropped(0.1).eval(), a), "_kiln_remake")
    assert hasattr(low_rank(Dropped(0).train(), a), "_kiln_remake")


def test_a_producer_returning_a_view_is_remade_too():
    """A LoRA projection returns a view of its GEMM's output: the mark goes on the base."""
    calls = []

    def make(a):
        calls.append(1)
        return (a @ a.t()).view(-1)

    a = torch.randn(3, 4, requires_grad=True)
    s = torch.tensor(0.5, requires_grad=True)
    y = remakeable(make, a)
    ref = weakref.ref(y._base)
    out = Scale.apply(y.view(3, 3), s)
    del y
    gc.collect()
    assert ref() is None
    out.sum().backward()
    assert len(calls) == 2
    assert torch.equal(s.grad, (a.detach() @ a.detach().t()).sum())


def test_a_marked_tensor_changed_in_place_is_saved_as_it_is():
    calls = []

    def make(a):
        calls.append(1)
        return a * 3

    a = torch.randn(5, requires_grad=True)
    s = torch.tensor(2.0, requires_grad=True)
    y = remakeable(make, a)
    y.mul_(2)  # a recipe would make the value before this
    Scale.apply(y, s).sum().backward()
    assert len(calls) == 1 and torch.equal(s.grad, (a.detach() * 6).sum())


def test_the_recipes_inputs_are_freed_with_the_backwards_saved_tensors():
    """They are saved as the Function's own tensors: freed by the backward even while the graph's
    output is still referenced (a step's loss lives on into the next micro-batch)."""
    a = torch.randn(4, 4).requires_grad_()
    x = a * 1  # the recipe's input, held by nothing else
    ref = weakref.ref(x)
    s = torch.tensor(1.5, requires_grad=True)
    out = Scale.apply(remakeable(torch.exp, x), s).sum()
    del x
    out.backward()
    gc.collect()
    assert ref() is None and out is not None
