"""Hugging Face checkpoints (config.json + safetensors, one file or a sharded index) into our
models: built on the meta device, then each tensor streamed from disk into place, so only what
is loaded is ever materialised.

Kimi Linear's disk layout differs from the module tree in three places, all converted here
(``from_hf``): ``block_sparse_moe`` is ``mlp``; per-expert ``experts.N.w1|w3|w2`` become the
grouped ``experts.gate_up_proj`` [E, 2I, D] (w1 = gate rows first, then w3 = up) and
``experts.down_proj`` [E, D, I]; the three short convolutions ``q|k|v_conv1d`` become one
``conv1d`` over q|k|v, and the gate's parameters move under ``forget_gate``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.model.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_CONV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qkv])_conv1d\.weight$")
_GATE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(A_log|dt_bias|f_a_proj\.weight|f_b_proj\.weight)$")


def shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / f for f in files]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    return [single]


def read_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time."""
    for path in shards(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _put(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, leaf)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, model expects {tuple(old.shape)}")
    if isinstance(old, nn.Parameter):
        setattr(module, leaf, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        module.register_buffer(leaf, value)


def to_hf(model: KimiLinearForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under Kimi's disk names: the inverse of what load_kimi_linear does."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.detach().contiguous()
        if name.endswith(".lora") or ".lora." in name:
            continue
        disk = name.replace(".mlp.", ".block_sparse_moe.")
        if m := re.match(r"^(.*)\.experts\.gate_up_proj$", disk):
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.experts.{e}.w1.weight"] = t[e, :I].clone()
                out[f"{m.group(1)}.experts.{e}.w3.weight"] = t[e, I:].clone()
        elif m := re.match(r"^(.*)\.experts\.down_proj$", disk):
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.experts.{e}.w2.weight"] = t[e].clone()
        elif m := re.match(r"^(.*\.self_attn)\.conv1d\.weight$", disk):
            for part, chunk in zip("qkv", t.chunk(3)):
                out[f"{m.group(1)}.{part}_conv1d.weight"] = chunk.clone()
        else:
            out[disk.replace(".forget_gate.", ".")] = t
    return out


def save_kimi_linear(model: KimiLinearForCausalLM, folder: Path) -> None:
    """config.json (model_type kimi_linear) and model.safetensors in Kimi's layout."""
    from dataclasses import asdict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**asdict(model.config), "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
           "num_key_value_heads": model.config.num_attention_heads}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(to_hf(model), str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_kimi_linear(folder: str | Path, dtype: torch.dtype = torch.float32) -> KimiLinearForCausalLM:
    folder = Path(folder)
    config = KimiLinearConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    E, I = config.num_experts, config.moe_intermediate_size
    grouped: dict[str, dict] = {}  # experts prefix -> tensors being stacked, and how many arrived
    convs: dict[str, dict[str, torch.Tensor]] = {}
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    loaded, unexpected = set(), []
    for key, t in read_tensors(folder):
        key = key.replace(".block_sparse_moe.", ".mlp.")
        t = t.to(dtype)
        if m := _EXPERT.match(key):
            prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
            g = grouped.setdefault(prefix, {"gate_up": None, "down": None, "seen": set()})
            if w == "w2":
                g["down"] = g["down"] if g["down"] is not None else torch.empty(E, t.shape[0], t.shape[1], dtype=dtype)
                g["down"][e] = t
            else:
                g["gate_up"] = g["gate_up"] if g["gate_up"] is not None else torch.empty(E, 2 * I, t.shape[1], dtype=dtype)
                rows = slice(0, I) if w == "w1" else slice(I, 2 * I)
                g["gate_up"][e, rows] = t
            g["seen"].add((e, w))
            continue
        if m := _CONV.match(key):
            convs.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        if m := _GATE.match(key):
            key = f"{m.group(1)}.forget_gate.{m.group(2)}"
        if key not in expected:
            unexpected.append(key)
            continue
        _put(model, key, t)
        loaded.add(key)
    for prefix, g in grouped.items():
        missing = {(e, w) for e in range(E) for w in ("w1", "w2", "w3")} - g["seen"]
        if missing:
            raise ValueError(f"{prefix}: checkpoint lacks experts {sorted(missing)[:5]}")
        _put(model, f"{prefix}.gate_up_proj", g["gate_up"])
        _put(model, f"{prefix}.down_proj", g["down"])
        loaded |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    for prefix, parts in convs.items():
        _put(model, f"{prefix}.conv1d.weight", torch.cat([parts["q"], parts["k"], parts["v"]]))
        loaded.add(f"{prefix}.conv1d.weight")
    if unexpected:
        raise ValueError(f"{folder}: tensors the model has no place for: {unexpected[:5]}")
    missing = expected - loaded
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {sorted(missing)[:5]}")
    return model
