"""Base models: ``config.json``'s ``model_type`` picks the family and its loader, and the
built-in models are written once, from a fixed seed, in their family's real on-disk format.

- ``kiln-tiny``: a small Llama-style decoder with a patch-embedding image encoder.
- ``kimi-linear-tiny``: Kimi Linear (3 KDA blocks : 1 MLA block, sigmoid-routed MoE) at test
  size, saved in Kimi's checkpoint layout; text only.
- ``kiln-hybrid-tiny``: the K3-style hybrid (KDA + Gated DSA, LatentMoE with SiTU, Block
  AttnRes, an image encoder) at test size, in Kiln's own layout (module names).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine.checkpoint.hf import load_deepseek_v32, load_kimi_linear, save_kimi_linear
from engine.config import ModelConfig
from engine.model.hybrid import HybridForCausalLM
from engine.model.common.kda import ForgetGate
from engine.model.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from engine.tiny_model import TinyConfig, TinyForCausalLM, init_weights, load_pretrained, save_pretrained
from kiln.tokenizer import ByteTokenizer

BUILTIN_SEED = 20261202


def save_hybrid(model: HybridForCausalLM, folder: Path) -> None:
    """config.json (model_type kiln_hybrid, the ModelConfig) + model.safetensors, module names."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "kiln_hybrid", "image_token_id": model.image_token_id,
           "model": json.loads(model.config.to_json())}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_hybrid(folder: Path) -> HybridForCausalLM:
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    with torch.device("meta"):
        model = HybridForCausalLM(ModelConfig.from_json(json.dumps(raw["model"])), raw.get("image_token_id"))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), assign=True, strict=True)
    return model


LOADERS: dict[str, Callable[[Path], nn.Module]] = {"kiln_tiny": load_pretrained, "kimi_linear": load_kimi_linear,
                                                   "deepseek_v32": load_deepseek_v32, "kiln_hybrid": load_hybrid}


def kimi_linear_tiny_config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_head_dim=32, linear_num_heads=4,
        num_experts=8, num_experts_per_token=2, routed_scaling_factor=2.446, pad_token_id=256)


def init_kimi_linear(model: KimiLinearForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) matrices, unit norms, and fla's KDA gate initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.02)
        for m in model.modules():
            if isinstance(m, ForgetGate):
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(1.0, 16.0, generator=g).log())
                dt = torch.empty_like(m.dt_bias).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def _kiln_tiny(folder: Path) -> None:
    model = TinyForCausalLM(TinyConfig())
    init_weights(model, BUILTIN_SEED)
    save_pretrained(model, folder)


def _kimi_linear_tiny(folder: Path) -> None:
    model = KimiLinearForCausalLM(kimi_linear_tiny_config())
    init_kimi_linear(model, BUILTIN_SEED)
    save_kimi_linear(model, folder)


def _kiln_hybrid_tiny(folder: Path) -> None:
    c = ModelConfig.debug(vocab_size=ByteTokenizer.vocab_size)
    c.hidden, c.layers, c.attn_res_block = 128, 4, 4  # 3 KDA : 1 Gated DSA, two AttnRes blocks
    c.kda.heads, c.kda.head_dim = 4, 32
    model = HybridForCausalLM(c, image_token_id=ByteTokenizer().special("<|image|>"))
    g = torch.Generator().manual_seed(BUILTIN_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or "attn_res" in name or "position_embedding" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for m in model.modules():
            if isinstance(m, ForgetGate):
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(1.0, 16.0, generator=g).log())
    save_hybrid(model, folder)


BUILTINS: dict[str, Callable[[Path], None]] = {"kiln-tiny": _kiln_tiny, "kimi-linear-tiny": _kimi_linear_tiny,
                                               "kiln-hybrid-tiny": _kiln_hybrid_tiny}


def ensure_builtin(name: str, folder: Path) -> None:
    """Write a built-in model's files once; every machine gets the same weights."""
    if (folder / "config.json").exists() or name not in BUILTINS:
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
    BUILTINS[name](tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another worker made it first
        shutil.rmtree(tmp, ignore_errors=True)


def save_base(model: nn.Module, folder: Path) -> None:
    """A trained model in its family's on-disk format, loadable as a base model again."""
    if isinstance(model, KimiLinearForCausalLM):
        save_kimi_linear(model, folder)
    elif isinstance(model, HybridForCausalLM):
        save_hybrid(model, folder)
    elif isinstance(model, TinyForCausalLM):
        save_pretrained(model, folder)
    else:
        raise ValueError(f"no on-disk format for {type(model).__name__}")


def build_meta(folder: Path) -> nn.Module:
    """The model a folder's config.json describes, on the meta device (no memory, no weights):
    the start of a sharded load (shard, ``to_empty``, then load only the local shards)."""
    from engine.checkpoint.hf import deepseek_v32_config

    raw = json.loads((folder / "config.json").read_text())
    kind = raw.get("model_type")
    with torch.device("meta"):
        if kind == "kiln_hybrid":
            return HybridForCausalLM(ModelConfig.from_json(json.dumps(raw["model"])), raw.get("image_token_id"))
        if kind == "kimi_linear":
            return KimiLinearForCausalLM(KimiLinearConfig.from_hf(raw))
        if kind == "deepseek_v32":
            return HybridForCausalLM(deepseek_v32_config(raw))
        if kind == "kiln_tiny":
            return TinyForCausalLM(TinyConfig(**{k: v for k, v in raw.items() if k in TinyConfig.__dataclass_fields__}))
    raise ValueError(f"{folder}: model_type {kind!r} is not supported; supported: {', '.join(LOADERS)}")


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence a model's positions allow; None: no limit (Kimi Linear, and a hybrid
    whose attention has no RoPE, as K3's: KDA carries order), any length that fits. The API's
    catalog holds the same numbers for the built-in models (tested)."""
    c = model.config
    if isinstance(c, TinyConfig):
        return c.max_position_embeddings
    if isinstance(c, ModelConfig):
        return c.max_seq_len if c.dsa.rope else None
    return None


def load_base(folder: Path) -> nn.Module:
    kind = json.loads((folder / "config.json").read_text()).get("model_type")
    if kind not in LOADERS:
        raise ValueError(f"{folder}: model_type {kind!r} is not supported; supported: {', '.join(LOADERS)}")
    return LOADERS[kind](folder)
