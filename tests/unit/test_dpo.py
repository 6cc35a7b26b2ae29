"""DPO (#35): preference pairs in OpenAI's format, the loss against a direct implementation of the
formula (value and gradient), and a small preference set learned (the reward accuracy rises, the
loss falls below ln 2), through the real trainer on kiln-tiny."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import engine
from engine.data import Dataset, ImageCache
from engine.lora import apply_lora
from engine.model.registry import ensure_builtin, load_base
from engine.reporting import RecordingReporter
from engine.training.step import dpo_loss, dpo_terms
from kiln.dataset import DatasetError, LengthBound, parse_line, validate
from kiln.spec import JobSpec, LoraSpec
from kiln.store import LocalStore
from kiln.tokenizer import chat_template, load_tokenizer


def pair(q: str, good: str, bad: str) -> dict:
    return {
        "input": {"messages": [{"role": "user", "content": q}]},
        "preferred_output": [{"role": "assistant", "content": good}],
        "non_preferred_output": [{"role": "assistant", "content": bad}],
    }


PAIRS = [pair(f"What is {a} plus {b}?", str(a + b), str(a + b + 7)) for a in range(6) for b in range(4)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_preference_line_is_checked_by_line_and_field():
    ex, issues = parse_line(1, json.dumps(PAIRS[0]))
    assert ex is not None and not issues and ex.rejected is not None
    assert [m.weight for m in ex.messages] == [0, 1] and ex.messages[1].content == "0"
    bad = {**PAIRS[0], "preferred_output": [{"role": "user", "content": "x"}]}
    assert [str(i) for i in parse_line(3, json.dumps(bad))[1]] == [
        "line 3: preferred_output[0].role: must be 'assistant'"
    ]
    chat = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    mixed = validate([json.dumps(PAIRS[0]).encode(), chat.encode()])  # the upload's check, as the engine's
    assert [str(i) for i in mixed.issues] == ["line 2: a chat example among preference pairs"]
    none = {k: v for k, v in PAIRS[0].items() if k != "non_preferred_output"}
    assert "non_preferred_output: must be a non-empty list" in str(parse_line(4, json.dumps(none))[1][0])


def test_a_preference_pair_takes_images_in_its_input():
    with_image = {
        **PAIRS[0],
        "images": ["images/a.png"],
        "input": {"messages": [{"role": "user", "content": "<image>\nWhat colour?"}]},
    }
    ex, issues = parse_line(5, json.dumps(with_image))
    assert not issues and ex is not None and ex.images == ["images/a.png"] and ex.other().images == ex.images
    in_answer = {**with_image, "preferred_output": [{"role": "assistant", "content": "<image> red"}]}
    assert "preferred_output[0].content: <image> belongs in user or system messages" in [
        f"{i.field}: {i.message}" for i in parse_line(6, json.dumps(in_answer))[1]
    ]
    count = {**PAIRS[0], "images": ["images/a.png"]}  # no placeholder for it
    assert [f"{i.field}: {i.message}" for i in parse_line(7, json.dumps(count))[1]] == [
        "images: 0 <image> placeholder(s) but 1 image(s)"
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store") / "models" / "kiln-tiny"
    ensure_builtin("kiln-tiny", folder)
    torch.manual_seed(0)
    model = load_base(folder)
    apply_lora(model, LoraSpec(rank=4, alpha=8))
    for m in model.modules():  # adapters that do something, so policy and reference differ
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B.weight, std=0.02)
    tok = load_tokenizer(folder)
    return model, tok, chat_template(tok)


def test_the_loss_and_its_gradient_are_the_formulas(tiny, tmp_path):
    model, tok, tpl = tiny
    data = Dataset(
        write(tmp_path / "p.jsonl", PAIRS[:2]),
        None,
        tok,
        tpl,
        0,
        None,
        LengthBound("kiln-tiny", 2048),
        tmp_path,
        ImageCache(0),
    )
    assert data.pairs
    beta, device = 0.3, torch.device("cpu")
    sample = data[1]
    pc, pr, rc, rr = dpo_terms(model, sample, tpl.pad_id, device)
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    def logp(s, adapters: bool) -> torch.Tensor:  # the whole logits, log_softmax, gather: the textbook way
        scales = {}
        if not adapters:
            for m in model.modules():
                if hasattr(m, "scaling"):
                    scales[m], m.scaling = m.scaling, 0.0
        try:
            logits = model(s.input_ids_T[None]).float()[0, :-1]
        finally:
            for m, v in scales.items():
                m.scaling = v
        y = s.labels_T[1:]
        keep = y != -100
        return logits.log_softmax(-1)[keep].gather(-1, y[keep][:, None]).sum()

    with torch.no_grad():
        ref = (logp(sample, False), logp(sample.rejected, False))
    direct = -torch.nn.functional.logsigmoid(
        beta * ((logp(sample, True) - ref[0]) - (logp(sample.rejected, True) - ref[1]))
    )
    direct.backward()
    torch.testing.assert_close(loss, direct, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rc, ref[0], rtol=1e-5, atol=1e-5)
    assert abs(float(chosen - rejected) - float(beta * ((pc - rc) - (pr - rr)).detach())) < 1e-5
    for n, p in model.named_parameters():
        if n in got:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7)
    assert got and any(float(g.abs().sum()) > 0 for g in got.values())
    model.zero_grad()


def test_a_small_preference_set_is_learned(tmp_path):
    train = write(tmp_path / "train.jsonl", PAIRS)
    spec = JobSpec(
        job_id="dpo",
        model="kiln-tiny",
        training_file=str(train),
        validation_file=str(train),
        method="dpo",
        beta=0.5,
        n_epochs=6,
        batch_size=8,
        learning_rate_multiplier=4.0,
        checkpoint_interval=3,
        seed=1,
        lora=LoraSpec(rank=8, alpha=16),
    )
    rec = RecordingReporter()
    result = engine.train(spec, LocalStore(tmp_path / "store"), rec)
    assert result.status == "succeeded"
    steps = [rec.steps[s] for s in sorted(rec.steps)]
    assert {"rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin"} <= set(steps[0])
    valid = [s for s in steps if "valid_loss" in s]
    assert valid[0]["valid_loss"] > valid[-1]["valid_loss"]
    assert (
        valid[-1]["valid_loss"] < math.log(2) and valid[-1]["valid_reward_accuracy"] > valid[0]["valid_reward_accuracy"]
    )
    assert valid[-1]["valid_reward_accuracy"] >= 0.9


def test_the_method_and_the_data_must_agree(tmp_path):
    chat = write(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    )
    spec = JobSpec(job_id="x", model="kiln-tiny", training_file=str(chat), method="dpo")
    with pytest.raises(DatasetError, match="method dpo takes preference pairs"):
        engine.train(spec, LocalStore(tmp_path / "s"), RecordingReporter())
    mixed = write(
        tmp_path / "mixed.jsonl",
        [PAIRS[0], {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    )
    with pytest.raises(DatasetError, match="line 2: a chat example among preference pairs"):
        engine.train(
            JobSpec(job_id="y", model="kiln-tiny", training_file=str(mixed), method="dpo"),
            LocalStore(tmp_path / "s"),
            RecordingReporter(),
        )
