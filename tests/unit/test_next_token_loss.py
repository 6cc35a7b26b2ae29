"""The models' loss without the full logits (``labels_BT``: ``layers.next_token_loss`` through
kiln_kernels.loss) equals the cross-entropy of their logits: loss, argmax hits and every gradient, for
each built-in family, with packed rows (the shift stays inside each row), with LoRA on the head
(the logits path) and with no target at all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.data import IGNORE
from engine.lora import apply_lora
from engine.model.registry import ensure_builtin, load_base
from kiln.spec import LoraSpec
from tests.tolerance import rel


@pytest.fixture(scope="module", params=["kiln-tiny", "kimi-linear-tiny", "kiln-hybrid-tiny"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / request.param
    ensure_builtin(request.param, path)
    return path


@pytest.fixture
def model(folder):
    """In float64, so that the two ways agree to far below any training noise."""
    return load_base(folder).double()


def batch(packed: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 40), generator=g)
    labels = ids.clone()
    labels[0, :7] = IGNORE  # a prompt; row 1 starts with a target (a shift across rows would count it)
    labels[1, 30:] = IGNORE
    docs = torch.tensor([[0] * 25 + [1] * 15, [0] * 40]) if packed else None
    return ids, labels, docs


def logits_loss(model, ids, labels, docs):
    logits = model(ids, None, docs)[:, :-1]
    y = labels[:, 1:]
    n = int((y != IGNORE).sum())
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE, reduction="sum"
    ) / max(n, 1)
    return loss, int(((logits.argmax(-1) == y) & (y != IGNORE)).sum())


def grads(model, fn):
    model.zero_grad()
    loss, right = fn()
    loss.backward()
    return (
        float(loss.detach()),
        int(right),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize("packed", [False, True])
def test_the_loss_without_logits_equals_the_logits_loss(model, packed):
    ids, labels, docs = batch(packed)
    for p in model.parameters():
        p.requires_grad_(True)
    got = grads(model, lambda: model(ids, None, docs, labels_BT=labels))
    want = grads(model, lambda: logits_loss(model, ids, labels, docs))
    assert abs(got[0] - want[0]) < 1e-12 * want[0] and got[1] == want[1]
    assert got[2].keys() == want[2].keys() and "lm_head.weight" in got[2]
    for n in want[2]:
        assert rel(got[2][n], want[2][n]) < 1e-10, n


def test_lora_on_the_head_and_no_targets(model):
    m = model
    apply_lora(m, LoraSpec(rank=4, alpha=8, dropout=0.0, target_modules=["lm_head", "o_proj"]))
    for n, p in m.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)  # B = 0 would hide the head's LoRA from the loss
    ids, labels, docs = batch(True)
    got = grads(m, lambda: m(ids, None, docs, labels_BT=labels))
    want = grads(m, lambda: logits_loss(m, ids, labels, docs))
    assert abs(got[0] - want[0]) < 1e-12 * want[0] and got[1] == want[1]
    assert any("lm_head" in n for n in got[2])
    for n in want[2]:
        assert rel(got[2][n], want[2][n]) < 1e-10, n
    loss, right = m(ids, None, docs, labels_BT=torch.full_like(labels, IGNORE))
    assert float(loss.detach()) == 0.0 and int(right) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_autocast_input_casts_as_autocast_would(dtype):
    """One cast up front gives a linear the input autocast would give it: fp32 to bf16, float64
    (the checks) and bf16 as they are."""
    from engine.model.common.layers import autocast_input

    x, W = torch.randn(5, 8).to(dtype), torch.randn(3, 8).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        once = autocast_input(x)
        assert torch.equal(torch.nn.functional.linear(once, W), torch.nn.functional.linear(x, W))
    assert once.dtype == (torch.bfloat16 if dtype == torch.float32 else dtype)
    assert autocast_input(x) is x  # autocast off: untouched
