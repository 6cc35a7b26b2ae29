"""Kimi Linear on disk, Kimi's layout (``from_hf`` / ``to_hf``), where it differs from the module
tree in three places: ``block_sparse_moe`` is ``mlp``; per-expert ``experts.N.w1|w3|w2`` become the
grouped ``experts.gate_up_proj`` [E, 2I, D] (w1 = gate rows first, then w3 = up) and
``experts.down_proj`` [E, D, I]; the three short convolutions ``q|k|v_conv1d`` become one
``conv1d`` over q|k|v, and the gate's parameters move under ``forget_gate``
(``engine.model.common.names``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from engine.model.common import names
from engine.model.common.hf import ExpertStacker, check_complete, put, stream_into
from engine.model.kimi_linear.model import KimiLinearConfig, KimiLinearForCausalLM


def to_hf(model: KimiLinearForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under Kimi's disk names: the inverse of what load_kimi_linear does."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.detach().contiguous()
        if name.endswith(".lora") or ".lora." in name:
            continue
        disk = names.to_disk(name)
        if m := re.match(r"^(.*)\.experts\.(gate_up_proj|down_proj)$", disk):
            parts = names.EXPERT_PARTS[m.group(2)][0]  # Kimi's
            for e in range(t.shape[0]):
                for part, rows in zip(parts, t[e].chunk(len(parts)), strict=True):
                    out[f"{m.group(1)}.experts.{e}.{part}.weight"] = rows.clone()
        elif m := re.match(r"^(.*\.self_attn)\.conv1d\.weight$", disk):
            for part, chunk in zip(names.CONV_PARTS, t.chunk(len(names.CONV_PARTS)), strict=True):
                out[f"{m.group(1)}.{part}_conv1d.weight"] = chunk.clone()
        else:
            out[disk] = t
    return out


def save_kimi_linear(model: KimiLinearForCausalLM, folder: Path) -> None:
    """config.json (model_type kimi_linear) and model.safetensors in Kimi's layout."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        **asdict(model.config),
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "num_key_value_heads": model.config.num_attention_heads,
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(to_hf(model), str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_kimi_linear(folder: str | Path, dtype: torch.dtype = torch.float32) -> KimiLinearForCausalLM:
    folder = Path(folder)
    config = KimiLinearConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    experts = ExpertStacker(config.num_experts, config.moe_intermediate_size, dtype)
    convs: dict[str, dict[str, torch.Tensor]] = {}

    def rename(key: str, t: torch.Tensor) -> str | None:
        ours, theirs = names.RENAMES[0]
        key = key.replace(theirs, ours)
        if m := names.CONV_KEY.match(key):
            convs.setdefault(m.group(1), {})[m.group(2)] = t
            return None
        if m := names.GATE_KEY.match(key):
            return f"{m.group(1)}.forget_gate.{m.group(2)}"
        return key

    loaded = stream_into(model, folder, dtype, experts, rename)
    for prefix, parts in convs.items():
        put(model, f"{prefix}.conv1d.weight", torch.cat([parts[p] for p in names.CONV_PARTS]))
        loaded.add(f"{prefix}.conv1d.weight")
    check_complete(model, folder, loaded)
    return model
