"""Convergence in miniature: from random init, full training brings the loss from about
ln(vocab) to under 15% of it within 400 steps on the sample data."""

from __future__ import annotations

import math
from pathlib import Path

import engine
from engine.model.registry import load_base
from engine.reporting import RecordingReporter
from kiln.spec import JobSpec
from kiln.store import LocalStore
from kiln.tokenizer import ByteTokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def test_from_random_init_loss_falls_under_15_percent_of_ln_vocab(tmp_path):
    store = LocalStore(tmp_path)
    rec = RecordingReporter()
    spec = JobSpec(
        job_id="converge",
        model="kiln-tiny",
        training_file=str(SAMPLE / "train.jsonl"),
        images_file=str(SAMPLE / "images.zip"),
        training="full",
        n_epochs=14,
        batch_size=8,
        max_steps=400,
        checkpoint_interval=400,
        seed=0,
    )
    result = engine.train(spec, store, rec)
    ln_v = math.log(ByteTokenizer.vocab_size)
    first = rec.losses[1]
    last = sum(rec.losses[s] for s in range(391, 401)) / 10
    assert abs(first - ln_v) / ln_v < 0.15, first  # random init: about uniform over the vocabulary
    assert last < 0.15 * ln_v, (first, last)
    model = load_base(store.path(result.adapter_key))  # the trained model loads as a base again
    assert sum(p.numel() for p in model.parameters()) > 1_000_000


def test_lora_on_a_pretrained_base_learns_what_the_base_does_not_know(tmp_path):
    """The bench's claim (bench/lora_gain.py): pretrained on arithmetic only, LoRA on the image
    questions cuts their validation loss by >= 80% within 500 steps and beats the base on the
    test split's exact answers."""
    from bench.lora_gain import run

    r = run(tmp_path, pretrain_steps=400, lora_steps=500)
    assert r["valid_loss_reduction"] >= 0.8, r
    assert r["lora_exact_match"] > r["base_exact_match"], r
