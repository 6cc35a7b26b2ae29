"""Base models: ``config.json``'s ``model_type`` picks the family and its loader, and the
built-in models are written once, from a fixed seed, in their family's real on-disk format.

- ``kiln-tiny``: a small Llama-style decoder with a patch-embedding image encoder.
- ``kimi-linear-tiny``: Kimi Linear (3 KDA blocks : 1 MLA block, sigmoid-routed MoE) at test
  size, saved in Kimi's checkpoint layout; text only.
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

from engine.checkpoint.hf import load_kimi_linear, save_kimi_linear
from engine.model.kimi_linear import ForgetGate, KimiLinearConfig, KimiLinearForCausalLM
from engine.tiny_model import TinyConfig, TinyForCausalLM, init_weights, load_pretrained, save_pretrained
from kiln.tokenizer import ByteTokenizer

BUILTIN_SEED = 20261202
LOADERS: dict[str, Callable[[Path], nn.Module]] = {"kiln_tiny": load_pretrained, "kimi_linear": load_kimi_linear}


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


BUILTINS: dict[str, Callable[[Path], None]] = {"kiln-tiny": _kiln_tiny, "kimi-linear-tiny": _kimi_linear_tiny}


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


def load_base(folder: Path) -> nn.Module:
    kind = json.loads((folder / "config.json").read_text()).get("model_type")
    if kind not in LOADERS:
        raise ValueError(f"{folder}: model_type {kind!r} is not supported; supported: {', '.join(LOADERS)}")
    return LOADERS[kind](folder)
