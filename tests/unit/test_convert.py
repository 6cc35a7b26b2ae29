"""Checkpoint conversion: MXFP4 decoding against its bit-level definition, the streaming
MXFP4 -> BF16 converter on a sharded checkpoint, and safetensors -> DCP laid out for FSDP
shards and an EP size, loaded by a real 2-process run that builds the model on the meta device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.mxfp4 import FP4, decode_reference, dequantize, quantize
from engine.model.kimi_linear.builtin import write_tiny as _kimi_linear_tiny
from engine.model.registry import load_base
from engine.tools.convert import layout, to_bf16
from tests.unit.test_parallel import torchrun

ROOT = Path(__file__).resolve().parents[2]


def test_dequantize_equals_the_bit_level_definition():
    g = torch.Generator().manual_seed(0)
    packed = torch.cat(
        [
            torch.arange(256, dtype=torch.uint8).reshape(8, 32),  # every byte value
            torch.randint(0, 256, (5, 32), generator=g, dtype=torch.uint8),
        ]
    )
    scale = torch.randint(90, 160, (13, 2), generator=g, dtype=torch.uint8)
    scale[0, 0], scale[1, 1] = 0, 190  # the smallest exponent (subnormal in fp32) and a large one
    want = decode_reference(packed, scale)
    assert torch.equal(dequantize(packed, scale, torch.float32).double(), want)
    assert torch.equal(dequantize(packed, scale).double(), want.to(torch.bfloat16).double())
    row = dequantize(packed[0:1], scale[0:1], torch.float32)[0]  # byte 1 = 0x01: its low nibble is element 2
    assert row[2] == 0.5 * 2.0**-127 and row[3] == 0
    batch = dequantize(packed.reshape(13, 1, 32), scale.reshape(13, 1, 2), torch.float32)  # leading dims kept
    assert torch.equal(batch.reshape(13, 64).double(), want)
    with pytest.raises(ValueError, match="shapes do not match"):
        dequantize(packed, scale[:, :1])


def test_quantize_round_trips_representable_weights():
    lut = torch.tensor(FP4)
    codes = torch.randint(0, 16, (4, 2, 32))
    codes[..., 5] = 7  # 6.0 in every group of 32: its largest magnitude sets the group's scale
    w = (lut[codes] * 2.0 ** torch.randint(-3, 4, (4, 2, 1)).float()).reshape(4, 64)
    assert torch.equal(dequantize(*quantize(w), torch.float32), w)
    x = torch.randn(8, 256)
    assert (dequantize(*quantize(x), torch.float32) - x).norm() / x.norm() < 0.2


def mxfp4_checkpoint(folder: Path) -> Path:
    """kimi-linear-tiny with its experts in MXFP4, split over two shards with an index."""
    plain = folder / "plain"
    _kimi_linear_tiny(plain)
    out = {}
    for k, v in load_file(str(plain / "model.safetensors")).items():
        if ".experts." in k:
            out[k.removesuffix(".weight") + ".weight_packed"], out[k.removesuffix(".weight") + ".weight_scale"] = (
                quantize(v)
            )
        else:
            out[k] = v
    q = folder / "mxfp4"
    q.mkdir()
    keys = sorted(out)
    files = {k: f"model-{1 + (i % 2)}-of-2.safetensors" for i, k in enumerate(keys)}  # pairs land in different files
    for f in set(files.values()):
        save_file({k: out[k] for k in keys if files[k] == f}, str(q / f))
    (q / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    cfg = json.loads((plain / "config.json").read_text())
    (q / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    return q


def test_mxfp4_checkpoint_to_bf16_loads_as_the_decoded_weights(tmp_path):
    src = mxfp4_checkpoint(tmp_path)
    to_bf16(src, tmp_path / "bf16", workers=2)
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("weight_packed" in k or "weight_scale" in k for k in index)
    model = load_base(tmp_path / "bf16")  # the real loader reads the converted folder
    raw = {}
    for f in (src / "model-1-of-2.safetensors", src / "model-2-of-2.safetensors"):
        raw.update(load_file(str(f)))
    w1 = model.model.layers[1].mlp.experts.gate_up_proj[3, :64]  # expert 3's w1 (gate rows first)
    key = "model.layers.1.block_sparse_moe.experts.3.w1"
    assert torch.equal(w1, dequantize(raw[key + ".weight_packed"], raw[key + ".weight_scale"]).float())
    assert torch.equal(model.model.embed_tokens.weight, raw["model.embed_tokens.weight"])

    bad = tmp_path / "bad"  # a packed tensor without its scales
    bad.mkdir()
    save_file({"x.weight_packed": raw[key + ".weight_packed"]}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="x.weight_packed has no x.weight_scale"):
        to_bf16(bad, tmp_path / "bad-out", workers=1)


def test_layout_cuts_like_fsdp_and_expert_parallel():
    assert layout("w", (10, 3), False, 4, 1) == [(0, 3), (3, 6), (6, 9), (9, 10)]  # torch.chunk's cut
    assert layout("w", (2, 3), False, 4, 1) == [(0, 1), (1, 2)]  # fewer rows than shards
    assert layout("e", (8, 3, 3), True, 4, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layout("e", (12, 3), True, 4, 2) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert layout("e", (8, 3), True, 8, 4) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8)]


def test_mxfp4_checkpoint_to_dcp_loads_sharded_on_the_meta_device(tmp_path):
    src = mxfp4_checkpoint(tmp_path)
    to_bf16(src, tmp_path / "bf16", workers=1)
    cmd = [
        sys.executable,
        "-m",
        "engine.tools.convert",
        "dcp",
        str(src),
        str(tmp_path / "dcp"),
        "--fsdp-shards",
        "4",
        "--ep-size",
        "2",
        "--workers",
        "2",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "shards" in done.stdout
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    experts = md["model.model.layers.1.mlp.experts.gate_up_proj"]
    assert tuple(experts.size) == (8, 128, 128) and [c.offsets[0] for c in experts.chunks] == [0, 2, 4, 6]
    head = md["model.lm_head.weight"]  # vocab rows in 4 as torch.chunk cuts them
    step = -(-head.size[0] // 4)
    assert [(c.offsets[0], c.sizes[0]) for c in head.chunks] == [
        (i * step, min(step, head.size[0] - i * step)) for i in range(4)
    ]
    # a run of another shape (2 processes, EP 2) builds the model on the meta device and loads its pieces
    torchrun(
        2,
        "--ep",
        "2",
        "--out",
        str(tmp_path / "got.pt"),
        "--load",
        str(tmp_path / "dcp"),
        "--meta",
        str(tmp_path / "bf16"),
    )
    got = torch.load(tmp_path / "got.pt")
    want = load_base(tmp_path / "bf16")
    assert set(got["params"]) == {n for n, _ in want.named_parameters()}
    for n, p in want.named_parameters():
        assert torch.equal(got["params"][n], p.detach()), n
    for n, b in want.named_buffers():
        assert torch.equal(got["buffers"][n], b), n

    bad = subprocess.run([*cmd[:-6], "--fsdp-shards", "4", "--ep-size", "3"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--ep-size (3) must divide --fsdp-shards (4)" in bad.stderr
