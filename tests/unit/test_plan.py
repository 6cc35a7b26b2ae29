"""The planner: its LoRA count is the real model's, its layout is the least-traffic one that
fits, and it says how many GPUs a config needs when the cluster is too small."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig, count_parameters
from engine.lora import apply_lora
from engine.model.hybrid import HybridForCausalLM
from engine.tools.plan import TARGETS, choose, estimate, fewest_gpus, lora_parameters, main
from kiln.spec import LoraSpec


def test_lora_count_equals_the_model_with_adapters():
    c = ModelConfig.debug()
    c.vision, c.layers = None, 4
    model = HybridForCausalLM(c)
    apply_lora(
        model,
        LoraSpec(
            rank=4,
            target_modules=list(TARGETS),
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == lora_parameters(c, 4)


KW = dict(tokens=8192, rank=16, weight_bytes=2, capacity_gb=141.0)


def test_flagship_on_512_h200s(capsys):
    c = ModelConfig.flagship()
    plan = choose(c, 512, **KW)
    assert plan.fits and 896 % plan.ep == 0 and 512 % plan.ep == 0
    assert plan.parts["weights (sharded)"] == pytest.approx(count_parameters(c)["total"] * 2 / 512)
    others = [estimate(c, 512, e, **KW) for e in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(sum(plan.traffic.values()) <= sum(o.traffic.values()) for o in others if o.fits)
    assert not estimate(c, 512, 1, **KW).fits  # one layer's 896 experts gathered whole cannot fit
    assert main(["--gpus", "512"]) == 0
    out = capsys.readouterr().out
    assert f"experts split {plan.ep} ways" in out and "fits:" in out and "| **total** |" in out


def test_too_small_a_cluster_says_how_many_gpus_fit(capsys):
    c = ModelConfig.flagship()
    assert main(["--gpus", "64", "--gpu-memory-gb", "80"]) == 1
    out = capsys.readouterr().out
    need = fewest_gpus(c, 8, **{**KW, "capacity_gb": 80.0})
    assert "does NOT fit" in out and f"the fewest GPUs that fit: {need}" in out
    assert choose(c, need, **{**KW, "capacity_gb": 80.0}).fits
    assert not choose(c, need // 2, **{**KW, "capacity_gb": 80.0}).fits
    assert main(["--gpus", "8", "--model", "nope.json"]) == 2


def kimi_48b_5l():
    from bench.e2e import SHAPE
    from engine.model.kimi_linear import KimiLinearConfig

    return KimiLinearConfig.from_hf(dict(SHAPE))


def test_kimi_linear_estimates_are_within_20_percent_of_the_h200_peaks():
    """bench/e2e.py's measured peaks (bench/results/e2e.json: the H200's table, the 8k rows H100s
    measured with KDA's activations remade, and the H100's 8k, 32k and 128k rows of 2026-12-06),
    each row's memory mode."""
    import json
    from pathlib import Path

    from engine.tools.plan import kimi_linear_memory

    found = json.loads((Path(__file__).resolve().parents[2] / "bench/results/e2e.json").read_text())
    h100 = ("same_call_h100_2026_12_05", "same_call_h100_session25", "same_call_h100_session30")
    rows = found["rows"] + [r for key in h100 for r in found[key]["rows"]]
    c = kimi_48b_5l()
    checked = 0
    for r in rows:
        est = sum(kimi_linear_memory(c, r["tokens"], 16, r["experts"], r["kiln_memory"]).values()) / 2**30
        assert abs(est / r["kiln_peak_gib"] - 1) < 0.2, (r["tokens"], r["layout"], est, r["kiln_peak_gib"])
        checked += r["tokens"] == 131072
    assert checked == 5  # the H200's 128k rows (one document and packed, with and without expert LoRA), the H100's


def test_the_planner_chooses_the_fewest_context_parallel_ranks_that_fit():
    from engine.tools.plan import choose_cp, kimi_linear_memory

    c = kimi_48b_5l()
    assert choose_cp(c, 8192, 8, 141) == 1
    assert choose_cp(c, 1 << 20, 8, 141) == 4
    assert choose_cp(c, 1 << 20, 8, 80) == 8
    assert choose_cp(c, 1 << 24, 8, 141) is None
    four = sum(kimi_linear_memory(c, 1 << 20, cp=4, recompute="selective").values())
    two = sum(kimi_linear_memory(c, 1 << 20, cp=2, recompute="selective").values())
    assert four < 141e9 < two


def test_the_command_line_plans_a_long_kimi_linear_sequence(tmp_path, capsys):
    import json

    from bench.e2e import SHAPE
    from engine.tools.plan import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**SHAPE, "model_type": "kimi_linear"}))
    assert main(["--model", str(cfg), "--gpus", "8", "--tokens", str(1 << 20)]) == 0
    assert "a 1,048,576-token sequence: parallel.cp_size 4 (262,144 tokens a rank)" in capsys.readouterr().out
    assert main(["--model", str(cfg), "--gpus", "8", "--tokens", str(1 << 24)]) == 1
    assert "does not fit on 8 GPUs" in capsys.readouterr().out
