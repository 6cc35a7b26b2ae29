"""The built-in kimi-linear-tiny: Kimi Linear (3 KDA blocks : 1 MLA block, sigmoid-routed MoE) at
test size, initialised from the fixed seed, saved in Kimi's checkpoint layout; text only."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.model.common.kda import ForgetGate
from engine.model.family import BUILTIN_SEED
from engine.model.kimi_linear.hf import save_kimi_linear
from engine.model.kimi_linear.model import KimiLinearConfig, KimiLinearForCausalLM
from kiln.tokenizer import ByteTokenizer


def kimi_linear_tiny_config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_head_dim=32,
        linear_num_heads=4,
        num_experts=8,
        num_experts_per_token=2,
        routed_scaling_factor=2.446,
        pad_token_id=256,
    )


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


def write_tiny(folder: Path) -> None:
    model = KimiLinearForCausalLM(kimi_linear_tiny_config())
    init_kimi_linear(model, BUILTIN_SEED)
    save_kimi_linear(model, folder)
