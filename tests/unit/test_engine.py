"""The interim engine: real training on kiln-tiny, exact resume, LoRA in PEFT's layout."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine
from engine.lora import apply_lora, lora_state
from engine.model.tiny import TinyConfig, TinyForCausalLM, init_weights, load_pretrained, save_pretrained
from engine.reporting import RecordingReporter
from kiln.dataset import DatasetError
from kiln.spec import JobSpec, LoraSpec, MemorySpec
from kiln.store import LocalStore

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def Recorder(stop_after: int | None = None) -> RecordingReporter:
    return RecordingReporter(stop_after)


def spec(**kw) -> JobSpec:
    base = dict(
        job_id="ftjob-unit",
        model="kiln-tiny",
        training_file=str(SAMPLE / "train.jsonl"),
        images_file=str(SAMPLE / "images.zip"),
        n_epochs=1,
        batch_size=8,
        seed=11,
        checkpoint_interval=10,
        lora=LoraSpec(rank=4, alpha=8, dropout=0.1),
    )
    return JobSpec(**{**base, **kw})


def test_spec_round_trips_through_json():
    s = spec(
        resume_from="jobs/x/checkpoints/step-0000010",
        memory=MemorySpec(recompute="selective", tier="auto", device_budget_mb=512.0, quantize="int8"),
    )
    assert JobSpec.from_json(s.to_json()) == s


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    full = Recorder()
    engine.train(spec(), LocalStore(tmp_path / "a"), full)
    store = LocalStore(tmp_path / "b")
    first = Recorder(stop_after=12)  # stops after step 12; the last checkpoint is step 10
    assert engine.train(spec(), store, first).status == "stopped"
    second = Recorder()
    result = engine.train(spec(job_id="ftjob-unit", resume_from=first.checkpoints[-1][1]), store, second)
    assert result.status == "succeeded"
    assert min(second.losses) == 11 and "Resumed from the checkpoint at step 10" in second.messages
    for step, loss in second.losses.items():
        assert loss == full.losses[step], step  # dropout RNG, optimizer and data order all restored
    assert full.losses[30] < 0.75 * full.losses[1]


def test_lora_freezes_the_base_and_exports_peft_keys(tmp_path):
    model = TinyForCausalLM(TinyConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64))
    init_weights(model, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = apply_lora(model, LoraSpec(rank=2, alpha=4, target_modules=["q_proj", "down_proj"]))
    assert wrapped == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable) and len(trainable) == 8
    ids = torch.randint(0, 256, (2, 9))
    out0 = model(ids)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model(ids).float().pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model(ids), out0)
    after = {k.replace(".base.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    keys = set(lora_state(model))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 8
    with pytest.raises(ValueError, match="no linear layer named wq"):
        apply_lora(
            TinyForCausalLM(TinyConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64)),
            LoraSpec(target_modules=["wq"]),
        )


def test_pretrained_round_trip(tmp_path):
    model = TinyForCausalLM(TinyConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64))
    init_weights(model, 5)
    save_pretrained(model, tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (1, 7))
    assert torch.equal(model(ids), loaded(ids))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["hidden_size"] == 32


def test_final_adapter_zip_and_example_too_long(tmp_path):
    store = LocalStore(tmp_path)
    rec = Recorder()
    result = engine.train(spec(max_steps=3), store, rec)
    zf = zipfile.ZipFile(store.path(result.adapter_key))
    assert sorted(zf.namelist()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert rec.hyperparameters["total_steps"] == 3 and [s for s, _ in rec.checkpoints] == [3]
    ckpt = load_file(str(store.path(rec.checkpoints[0][1]) / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.layers.") for k in ckpt)
    with pytest.raises(DatasetError, match=r"line \d+: messages: example is \d+ tokens, over max_seq_len 40"):
        engine.train(spec(max_seq_len=40), store, Recorder())


def test_validation_split_holds_out_examples_and_reports_their_loss(tmp_path):
    rec = Recorder()
    result = engine.train(
        spec(validation_file=None, validation_split=0.25, max_steps=10, checkpoint_interval=5),
        LocalStore(tmp_path),
        rec,
    )
    assert result.status == "succeeded"
    assert any("180 training examples" in m and "60 validation examples" in m for m in rec.messages)
    assert "valid_loss" in rec.steps[5] and "valid_loss" in rec.steps[10] and "valid_loss" not in rec.steps[4]


def test_gradient_accumulation_makes_the_same_update(tmp_path):
    """Four micro-batches of two examples step like one batch of eight."""
    states = []
    for micro in (1, 4):
        store = LocalStore(tmp_path / f"m{micro}")
        rec = Recorder()
        engine.train(
            spec(
                max_steps=2,
                checkpoint_interval=2,
                gradient_accumulation_steps=micro,
                lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
            ),
            store,
            rec,
        )
        states.append((load_file(str(store.path(rec.checkpoints[-1][1]) / "adapter_model.safetensors")), rec.losses))
    (a, la), (b, lb) = states
    assert a.keys() == b.keys()
    for k in a:  # Adam turns the summation-order noise of near-zero gradients into ~1e-5 here;
        # a wrong accumulation moves the adapter by ~lr (1e-3) and the losses below
        assert torch.allclose(a[k], b[k], atol=3e-5, rtol=1e-4), k
    assert abs(la[1] - lb[1]) < 1e-5 and abs(la[2] - lb[2]) < 1e-4


def test_a_step_with_a_non_finite_gradient_is_skipped_not_applied(tmp_path, monkeypatch):
    """bf16 on the H200 once gave a finite loss and a NaN gradient; the update must not land."""
    import engine.training.step as tr

    real = tr.batch_loss
    calls = {"n": 0}

    def poisoned(*args):
        loss, n, right = real(*args)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 3 else loss), n, right

    monkeypatch.setattr(tr, "batch_loss", poisoned)
    rec = Recorder()
    store = LocalStore(tmp_path)
    result = engine.train(
        spec(max_steps=6, checkpoint_interval=6, lora=LoraSpec(rank=4, alpha=8, dropout=0.0)), store, rec
    )
    assert result.status == "succeeded"
    assert rec.steps[6]["skipped_steps"] == 1 and rec.steps[2]["skipped_steps"] == 0
    assert any("step 3: the gradient is not finite" in m.lower() for m in rec.messages)
    adapter = load_file(str(store.path(rec.checkpoints[-1][1]) / "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in adapter.values())
