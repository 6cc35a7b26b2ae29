"""On a GPU (skipped elsewhere): every built-in model trains through engine.train with bf16
autocast, and its first loss agrees with the fp32 CPU run within bf16 tolerance."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import engine
from engine.reporting import RecordingReporter
from kiln.spec import JobSpec, LoraSpec
from kiln.store import LocalStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def run(model: str, store: LocalStore, images: bool, experts: bool) -> RecordingReporter:
    text = SAMPLE / "train.jsonl"
    if not images:
        lines = [l for l in text.read_text().splitlines() if '"images"' not in l]
        text = store.root / "text.jsonl"
        text.write_text("\n".join(lines) + "\n")
    rec = RecordingReporter()
    lora = LoraSpec(
        rank=8,
        target_modules=["q_proj", "o_proj", "down_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else [],
    )
    engine.train(
        JobSpec(
            job_id=f"gpu-{model}",
            model=model,
            training_file=str(text),
            images_file=str(SAMPLE / "images.zip") if images else None,
            max_steps=30,
            batch_size=8,
            learning_rate_multiplier=2.0,
            seed=0,
            lora=lora,
        ),
        store,
        rec,
    )
    return rec


@pytest.mark.parametrize(
    "model,images,experts",
    [("kiln-tiny", True, False), ("kimi-linear-tiny", False, True), ("kiln-hybrid-tiny", True, True)],
)
def test_trains_on_cuda_like_on_cpu(model, images, experts, tmp_path):
    gpu = run(model, LocalStore(tmp_path / "gpu"), images, experts)
    assert all(math.isfinite(v) for v in gpu.losses.values())
    assert sum(gpu.losses[s] for s in range(26, 31)) / 5 < gpu.losses[1]  # it learns
    assert gpu.steps[30]["peak_memory_mb"] > 0  # measured with torch.cuda.max_memory_allocated
    visible = torch.cuda.is_available
    torch.cuda.is_available = lambda: False  # the same job, fp32 on the CPU
    try:
        cpu = run(model, LocalStore(tmp_path / "cpu"), images, experts)
    finally:
        torch.cuda.is_available = visible
    g, c = gpu.losses[1], cpu.losses[1]
    assert abs(g - c) / c < 1e-2, (g, c)  # bf16 vs fp32
