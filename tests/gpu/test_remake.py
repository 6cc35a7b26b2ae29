"""Activations remade in the backward (``kiln_kernels.remake``) on a Kimi Delta Attention layer
with the Triton kernels: the short convolutions' outputs, the decay's low-rank projection and the
output gate are freed once the forward is done, and KDA's and the gated norm's backwards make them
again. Every gradient is bit-equal to the layer that keeps them; under saved-tensor hooks (Swap
Core's recompute) they are saved as before. On a CPU through Triton's interpreter in fp32
(tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import engine.model.common.kda as kda_module
from engine.model.common.kda import KimiDeltaAttention
from kiln_kernels import dispatch, remake
from tests.interpret import DEVICE, INTERPRETED, gpu_only, needs_kernels

pytestmark = needs_kernels
CU = [0, 5, 6, 40, 70]  # a one-token document among others


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """The CUDA kernels on the interpreter's CPU tensors too."""
    if INTERPRETED:
        monkeypatch.setattr(dispatch, "backend", lambda *t: "cuda")


def layer(dtype=torch.float32) -> KimiDeltaAttention:
    torch.manual_seed(0)
    m = KimiDeltaAttention(hidden=32, H=2, K=16)
    with torch.no_grad():
        for p in m.parameters():  # nothing at its zero init: every path carries a gradient
            p.copy_(torch.randn_like(p) * 0.3)
    return m.to(DEVICE, dtype)


def step(m: KimiDeltaAttention, x: torch.Tensor, autocast: bool = False, wrap=None) -> list[torch.Tensor]:
    cu = torch.tensor(CU, device=x.device)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = m(x, cu) if wrap is None else wrap(m, x, cu)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return [*torch.autograd.grad((out.float() * w).sum(), [x, *m.parameters()]), out]


def inputs(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(1, CU[-1], 32, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype).requires_grad_()


def kept(monkeypatch):
    """The layer as before: every producer's output kept for its consumer's backward."""
    monkeypatch.setattr(kda_module, "remakeable", lambda fn, *args: fn(*args))


@pytest.mark.parametrize("autocast", [False, pytest.param(True, marks=gpu_only)])
def test_remade_gradients_are_bit_equal_to_kept_ones(monkeypatch, autocast):
    m = layer()
    remade = step(m, inputs(), autocast)
    kept(monkeypatch)
    for a, b in zip(remade, step(m, inputs(), autocast), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("remaking", [True, False])
def test_the_marked_activations_are_freed_after_the_forward(monkeypatch, remaking):
    """Five a layer: q's, k's and v's convolution outputs, the decay projection, the output gate.
    Kept (the old behaviour) they live until the backward: the control that this test can fail."""
    made: list[weakref.ref] = []

    def watched(fn, *args):
        y = remake.remakeable(fn, *args) if remaking else fn(*args)
        made.append(weakref.ref(y))
        return y

    monkeypatch.setattr(kda_module, "remakeable", watched)
    m, x = layer(), inputs()
    out = m(x, torch.tensor(CU, device=x.device))
    gc.collect()
    assert len(made) == 5
    assert sum(r() is not None for r in made) == (0 if remaking else 5)
    out.sum().backward()  # and the backward makes them again
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_under_saved_tensor_hooks_they_are_saved_as_before(monkeypatch):
    """Swap Core's recompute runs blocks under torch.utils.checkpoint, whose hooks must see every
    saved tensor: a recipe would hold its inputs outside them. Same bits as the plain layer."""
    m = layer()
    plain = step(m, inputs())
    packed: list[int] = []

    def pack(t):
        packed.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hooked = step(m, inputs())
    assert packed.count(CU[-1] * 2 * 16) >= 5  # the five [T, H*K] activations among the saves
    for a, b in zip(plain, hooked, strict=True):
        assert torch.equal(a, b)
    recomputed = step(m, inputs(), wrap=lambda m, x, cu: checkpoint(m, x, cu, use_reentrant=False))
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b)
