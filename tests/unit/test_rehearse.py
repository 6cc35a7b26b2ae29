"""The first step's rehearsal (engine.training.step.rehearse) leaves no trace, here on the CPU with
its forward and backward run for real (on a GPU they launch no Triton kernel and compile them
ahead: tests/gpu/test_rehearse_cuda.py): the gradients are the same tensors with the same
values, the routers' token counts and the random generator as before; a rehearsal that fails
loses only time. Without an accelerator nothing is rehearsed."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from engine import device as accelerator
from engine.data import Sample
from engine.lora import apply_lora
from engine.model.common.moe import Router
from engine.model.registry import ensure_builtin, load_base
from engine.training import step
from engine.training.ranks import Single
from kiln.spec import LoraSpec
from kiln_kernels.ahead import compiling_ahead

CPU = torch.device("cpu")


def setup(tmp_path):
    ensure_builtin("kimi-linear-tiny", tmp_path / "m")
    model = load_base(tmp_path / "m")
    apply_lora(model, LoraSpec(rank=4, dropout=0.1, target_modules=["q_proj", "down_proj"]))  # dropout draws
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 200, (n,), generator=g) for n in (50, 20)]
    samples = [Sample(i, d, d.clone(), torch.zeros(0, 3, 1, 1)) for i, d in enumerate(docs)]
    step.accumulate(model, samples, 1, 0, 128, Single(CPU))  # gradients and token counts to keep
    batch, cp, _ = Single(CPU).batch(samples, 0, 128)
    return model, batch, cp


def snapshot(model) -> dict:
    return {
        "grads": {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None},
        "loads": [(m, m.load.clone()) for m in model.modules() if isinstance(m, Router) and m.load is not None],
        "rng": torch.get_rng_state(),
    }


def assert_as_before(model, before: dict) -> None:
    now = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert now.keys() == before["grads"].keys() and now
    for n, (same, values) in before["grads"].items():
        assert now[n] is same and torch.equal(same, values), n
    assert before["loads"] and all(torch.equal(m.load, load) for m, load in before["loads"])
    assert torch.equal(torch.get_rng_state(), before["rng"])


@contextmanager
def rehearsing():
    yield True


class Accelerated:
    """engine.device as step.py sees it, but for ``accelerated``: the rehearsal runs on the CPU
    (autocast and the rest still the CPU's)."""

    def __getattr__(self, name):
        return getattr(accelerator, name)

    @staticmethod
    def accelerated(device) -> bool:
        return True


def test_a_rehearsal_leaves_no_trace(tmp_path, monkeypatch):
    model, batch, cp = setup(tmp_path)
    assert not step.rehearse(model, batch, CPU, cp)  # the CPU: nothing to compile ahead
    monkeypatch.setattr(step, "accelerator", Accelerated())
    monkeypatch.setattr(step, "compiling_ahead", rehearsing)
    calls = []
    real = step.forward_backward
    monkeypatch.setattr(step, "forward_backward", lambda *a: calls.append(1) or real(*a))
    before = snapshot(model)
    torch.rand(1)  # the generator moved on: the rehearsal must give this state back, not a fresh one
    before["rng"] = torch.get_rng_state()
    assert step.rehearse(model, batch, CPU, cp)
    assert calls == [1]
    assert_as_before(model, before)


def test_a_failed_rehearsal_costs_only_time(tmp_path, monkeypatch, caplog):
    model, batch, cp = setup(tmp_path)
    monkeypatch.setattr(step, "accelerator", Accelerated())
    monkeypatch.setattr(step, "compiling_ahead", rehearsing)

    def half_a_step(model, batch, device, cp, total):
        loss, _, _ = step.batch_loss(model, batch, device, cp)
        loss.backward()  # gradients written, then the failure
        raise RuntimeError("out of something")

    monkeypatch.setattr(step, "forward_backward", half_a_step)
    before = snapshot(model)
    with caplog.at_level(logging.WARNING, logger="engine.training.step"):
        assert not step.rehearse(model, batch, CPU, cp)
    assert "not compiled ahead: RuntimeError: out of something" in caplog.text
    assert_as_before(model, before)


def test_a_preference_step_rehearses_its_first_pair_and_runs_as_without(tmp_path, monkeypatch):
    model, _, _ = setup(tmp_path)
    g = torch.Generator().manual_seed(5)

    def answer(n: int) -> Sample:
        ids = torch.randint(3, 200, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 2] = -100  # the prompt: no loss
        return Sample(0, ids, labels, torch.zeros(0, 3, 1, 1))

    pairs = []
    for n in (30, 24):
        chosen = answer(n)
        pairs.append(Sample(0, chosen.input_ids_T, chosen.labels_T, chosen.pixels_NCHW, rejected=answer(n + 4)))

    def run(ahead: bool):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        metrics = step.dpo_accumulate(model, pairs, 0.1, 0, CPU, ahead=ahead)
        return metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run(False)
    monkeypatch.setattr(step, "accelerator", Accelerated())
    monkeypatch.setattr(step, "compiling_ahead", rehearsing)
    calls = []
    real = step.forward_backward
    monkeypatch.setattr(step, "forward_backward", lambda *a: calls.append(a[1]) or real(*a))
    got, got_grads = run(True)
    assert len(calls) == 1 and torch.equal(calls[0]["input_ids_BT"][0], pairs[0].input_ids_T)
    assert got == want
    assert got_grads.keys() == want_grads.keys() and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())


def test_without_a_device_nothing_is_compiled_ahead():
    with compiling_ahead() as compiling:
        assert not compiling


def test_a_long_row_is_rehearsed_on_a_slice_of_the_same_length_modulo_the_slice(tmp_path, monkeypatch):
    model, batch, cp = setup(tmp_path)  # one packed row of two documents, 70 tokens
    monkeypatch.setattr(step, "accelerator", Accelerated())
    monkeypatch.setattr(step, "compiling_ahead", rehearsing)
    seen: list[dict] = []
    monkeypatch.setattr(step, "forward_backward", lambda m, b, *a: seen.append(b))
    assert batch["input_ids_BT"].shape[1] == 70
    for size, length in ((35, 70), (24, 24 + 70 % 24), (16, 16 + 70 % 16)):
        monkeypatch.setattr(step, "REHEARSAL_SLICE", size)
        assert step.rehearse(model, batch, CPU, cp)
        got = seen.pop()
        assert got.keys() == batch.keys() and got["pixels_NCHW"] is batch["pixels_NCHW"]
        for k in ("input_ids_BT", "labels_BT", "doc_ids_BT", "positions_BT"):
            assert torch.equal(got[k], batch[k][:, :length]), (size, k)
    # images (their tokens would be cut from their pixels) and context-parallel slices: whole
    monkeypatch.setattr(step, "REHEARSAL_SLICE", 16)
    pictured = dict(batch, pixels_NCHW=torch.rand(1, 3, 2, 2))
    assert step.rehearsal(pictured, None) is pictured
    assert step.rehearsal(batch, object()) is batch
