"""LoRA on a model the bench pretrained: does a fine-tune teach what the base does not know?

    .venv/bin/python -m bench.lora_gain [--pretrain-steps 400] [--lora-steps 500]

1. Pretrain kiln-tiny fully from random init on the sample's arithmetic chats only: it learns
   the chat format and sums, and has never seen an image question.
2. LoRA-fine-tune that model on the image questions of the training split.
Measured on the image questions of the validation split (loss) and the test split (exact match
of greedy answers), base against adapter; written to JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

import engine
from engine.data import Dataset
from engine.inference.evaluate import exact_match as answers_match
from engine.lora import apply_lora, load_adapter
from engine.model.registry import load_base
from engine.reporting import RecordingReporter
from engine.training.ranks import Single
from engine.training.step import evaluate
from kiln.dataset import LengthBound
from kiln.spec import JobSpec, LoraSpec
from kiln.store import LocalStore
from kiln.tokenizer import chat_template, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample"


def split(src: Path, dst: Path, images: bool) -> Path:
    lines = [l for l in src.read_text().splitlines() if ('"images"' in l) == images]
    dst.write_text("\n".join(lines) + "\n")
    return dst


def dataset(model, folder: Path, data: Path, work: Path) -> Dataset:
    tok = load_tokenizer(folder)
    tpl = chat_template(tok)
    bound = LengthBound("kiln-tiny", 2048)
    return Dataset(data, SAMPLE / "images.zip", tok, tpl, model.image_size, model.image_tokens, bound, work)


def exact_match(model, folder: Path, test: Path, work: Path) -> float:
    """The trainer's own exact match of greedy answers (engine.inference.evaluate)."""
    ds = dataset(model, folder, test, work)
    try:
        return answers_match(model, ds, list(range(len(ds))))
    finally:
        ds.close()


def validation_loss(model, folder: Path, data: Path, work: Path) -> float:
    """The trainer's own validation loss, for a model as it is."""
    ds = dataset(model, folder, data, work)
    try:
        pad = ds.tpl.pad_id
        return evaluate(model, ds, list(range(len(ds))), 8, pad, 2048, Single(torch.device("cpu")))["valid_loss"]
    finally:
        ds.close()


def run(work: Path, pretrain_steps: int, lora_steps: int) -> dict:
    store = LocalStore(work / "store")
    text = split(SAMPLE / "train.jsonl", work / "text.jsonl", images=False)
    img_train = split(SAMPLE / "train.jsonl", work / "img_train.jsonl", images=True)
    img_valid = split(SAMPLE / "validation.jsonl", work / "img_valid.jsonl", images=True)
    img_test = split(SAMPLE / "test.jsonl", work / "img_test.jsonl", images=True)

    pre = RecordingReporter()
    result = engine.train(
        JobSpec(
            job_id="pretrain",
            model="kiln-tiny",
            training_file=str(text),
            training="full",
            n_epochs=1000,
            batch_size=8,
            max_steps=pretrain_steps,
            checkpoint_interval=pretrain_steps,
            seed=0,
        ),
        store,
        pre,
    )
    base_dir = store.model_dir("bench-base")
    base_dir.parent.mkdir(parents=True, exist_ok=True)
    assert result.adapter_key is not None
    store.path(result.adapter_key).rename(base_dir)
    lora = RecordingReporter()
    spec = JobSpec(
        job_id="lora",
        model="bench-base",
        training_file=str(img_train),
        validation_file=str(img_valid),
        images_file=str(SAMPLE / "images.zip"),
        n_epochs=1000,
        batch_size=8,
        max_steps=lora_steps,
        checkpoint_interval=lora_steps // 5,
        seed=0,
        lora=LoraSpec(rank=16, alpha=32),
    )
    done = engine.train(spec, store, lora)
    valid = {s: v["valid_loss"] for s, v in lora.steps.items() if "valid_loss" in v}
    base_model = load_base(base_dir).eval()
    base_em = exact_match(base_model, base_dir, img_test, work)
    tuned = load_base(base_dir)
    apply_lora(tuned, spec.lora)
    load_adapter(tuned, store.path(f"{spec.artifacts}/checkpoints/step-{lora_steps:07d}"))
    tuned_em = exact_match(tuned.eval(), base_dir, img_test, work)
    base_valid = validation_loss(base_model, base_dir, img_valid, work)
    return {
        "pretrain_final_loss": pre.steps[pretrain_steps]["train_loss"],
        "base_valid_loss": base_valid,
        "valid_loss_by_step": valid,
        "valid_loss_reduction": 1 - valid[lora_steps] / base_valid,
        "base_exact_match": base_em,
        "lora_exact_match": tuned_em,
        "adapter": done.adapter_key,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain-steps", type=int, default=400)
    p.add_argument("--lora-steps", type=int, default=500)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "lora_gain.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        r = run(Path(d), args.pretrain_steps, args.lora_steps)
    print(
        f"base (pretrained on arithmetic only): image-question validation loss {r['base_valid_loss']:.3f}, "
        f"test exact match {r['base_exact_match']:.1%}"
    )
    print(f"{'LoRA step':>9} {'valid loss':>10} {'/ base':>7}")
    for s, v in sorted(r["valid_loss_by_step"].items()):
        print(f"{s:>9} {v:>10.3f} {v / r['base_valid_loss']:>7.3f}")
    print(
        f"validation loss reduction {r['valid_loss_reduction']:.1%}; exact match {r['base_exact_match']:.1%} -> "
        f"{r['lora_exact_match']:.1%}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2))
    return 0 if r["valid_loss_reduction"] >= 0.8 and r["lora_exact_match"] > r["base_exact_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
