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
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.checkpoint import names
from engine.config import DSAConfig, KDAConfig, ModelConfig, MoEConfig
from engine.model.hybrid import HybridForCausalLM
from engine.model.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM

# a per-expert part on disk -> its rows in our grouped tensors
_ROLE = {part: {("gate_up_proj", 0): "gate", ("gate_up_proj", 1): "up", ("down_proj", 0): "down"}[place]
         for part, place in names.PART_OF.items()}


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
        disk = names.to_disk(name)
        if m := re.match(r"^(.*)\.experts\.(gate_up_proj|down_proj)$", disk):
            parts = names.EXPERT_PARTS[m.group(2)][0]  # Kimi's
            for e in range(t.shape[0]):
                for part, rows in zip(parts, t[e].chunk(len(parts))):
                    out[f"{m.group(1)}.experts.{e}.{part}.weight"] = rows.clone()
        elif m := re.match(r"^(.*\.self_attn)\.conv1d\.weight$", disk):
            for part, chunk in zip(names.CONV_PARTS, t.chunk(len(names.CONV_PARTS))):
                out[f"{m.group(1)}.{part}_conv1d.weight"] = chunk.clone()
        else:
            out[disk] = t
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


class _ExpertStacker:
    """Per-expert tensors from disk into the grouped [E, 2I, D] (gate rows, then up) and
    [E, D, I] tensors, each filled in place as its experts arrive."""

    def __init__(self, E: int, I: int, dtype: torch.dtype):
        self.E, self.I, self.dtype = E, I, dtype
        self.groups: dict[str, dict] = {}

    def add(self, key: str, t: torch.Tensor) -> bool:
        m = names.EXPERT_KEY.match(key)
        if not m:
            return False
        prefix, e, role = m.group(1), int(m.group(2)), _ROLE[m.group(3)]
        g = self.groups.setdefault(prefix, {"gate_up": None, "down": None, "seen": set()})
        if role == "down":
            if g["down"] is None:
                g["down"] = torch.empty(self.E, *t.shape, dtype=self.dtype)
            g["down"][e] = t
        else:
            if g["gate_up"] is None:
                g["gate_up"] = torch.empty(self.E, 2 * self.I, t.shape[1], dtype=self.dtype)
            g["gate_up"][e, slice(0, self.I) if role == "gate" else slice(self.I, 2 * self.I)] = t
        g["seen"].add((e, role))
        return True

    def finish(self, model: nn.Module) -> set[str]:
        done = set()
        for prefix, g in self.groups.items():
            missing = {(e, r) for e in range(self.E) for r in ("gate", "up", "down")} - g["seen"]
            if missing:
                raise ValueError(f"{prefix}: checkpoint lacks experts {sorted(missing)[:5]}")
            _put(model, f"{prefix}.gate_up_proj", g["gate_up"])
            _put(model, f"{prefix}.down_proj", g["down"])
            done |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
        return done


def _stream_into(model: nn.Module, folder: Path, dtype: torch.dtype, experts: _ExpertStacker,
                 rename: Callable[[str, torch.Tensor], str | None]) -> set[str]:
    """Every checkpoint tensor into its place: ``rename`` maps a disk name to a module name (None
    when it took the tensor itself), then per-expert tensors are stacked and the rest put in
    place. Returns what was loaded; raises on tensors without a place."""
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    loaded, unexpected = set(), []
    for key, t in read_tensors(folder):
        t = t.to(dtype)
        key = rename(key, t)
        if key is None or experts.add(key, t):
            continue
        if key not in expected:
            unexpected.append(key)
            continue
        _put(model, key, t)
        loaded.add(key)
    if unexpected:
        raise ValueError(f"{folder}: tensors the model has no place for: {unexpected[:5]}")
    return loaded | experts.finish(model)


def _check_complete(model: nn.Module, folder: Path, loaded: set[str]) -> None:
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {sorted(missing)[:5]}")


def load_kimi_linear(folder: str | Path, dtype: torch.dtype = torch.float32) -> KimiLinearForCausalLM:
    folder = Path(folder)
    config = KimiLinearConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    experts = _ExpertStacker(config.num_experts, config.moe_intermediate_size, dtype)
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

    loaded = _stream_into(model, folder, dtype, experts, rename)
    for prefix, parts in convs.items():
        _put(model, f"{prefix}.conv1d.weight", torch.cat([parts[p] for p in names.CONV_PARTS]))
        loaded.add(f"{prefix}.conv1d.weight")
    _check_complete(model, folder, loaded)
    return model


def deepseek_v32_config(d: dict) -> ModelConfig:
    """A DeepSeek V3.2 config.json as a hybrid config: every layer Gated DSA with the gate off
    and RoPE on, grouped sigmoid routing, plain residuals, no vision."""
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported yet (only 'default')")
    first_dense = d.get("first_k_dense_replace", 0)
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_hidden_layers"],
        kda=KDAConfig(heads=1, head_dim=1), attention_every=1,
        dsa=DSAConfig(heads=d["num_attention_heads"], q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora_rank"],
                      qk_nope=d["qk_nope_head_dim"], qk_rope=d["qk_rope_head_dim"], v_dim=d["v_head_dim"],
                      index_heads=d["index_n_heads"], index_head_dim=d["index_head_dim"], index_topk=d["index_topk"],
                      gated=False, rope=True),
        moe=MoEConfig(experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"], inter=d["moe_intermediate_size"],
                      shared=d.get("n_shared_experts", 0), first_dense=first_dense, dense_inter=d["intermediate_size"],
                      routed_scale=d.get("routed_scaling_factor", 1.0), groups=d.get("n_group", 1),
                      topk_group=d.get("topk_group", 1)),
        activation="swiglu", attn_res=False, rms_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", 10000.0), max_seq_len=d.get("max_position_embeddings", 4096))


def load_deepseek_v32(folder: str | Path, dtype: torch.dtype = torch.float32) -> HybridForCausalLM:
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    if not raw.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=False is not supported")
    config = deepseek_v32_config(raw)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    experts = _ExpertStacker(config.moe.experts, config.moe.inter, dtype)
    _check_complete(model, folder, _stream_into(model, folder, dtype, experts,
                                                     lambda key, t: key.removeprefix("model.")))
    return model
