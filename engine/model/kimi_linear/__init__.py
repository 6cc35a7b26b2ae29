"""Kimi Linear's family: KDA blocks and MLA blocks (NoPE) with a sigmoid-routed MoE, loaded from
and saved in Kimi's checkpoint layout."""

from __future__ import annotations

from engine.model.common.kda import KimiDeltaAttention
from engine.model.family import Builtin, Family
from engine.model.kimi_linear.builtin import init_kimi_linear, kimi_linear_tiny_config, write_tiny
from engine.model.kimi_linear.hf import load_kimi_linear, save_kimi_linear, to_hf
from engine.model.kimi_linear.model import KimiLinearConfig, KimiLinearForCausalLM, MLAttention
from kiln import catalog

FAMILY = Family(
    model_type="kimi_linear",
    model_class=KimiLinearForCausalLM,
    config=KimiLinearConfig.from_hf,
    build=lambda raw: KimiLinearForCausalLM(KimiLinearConfig.from_hf(raw)),
    load=load_kimi_linear,
    save=save_kimi_linear,
    lora=catalog.KIMI_LINEAR,
    experts=lambda c: c.num_experts if "sparse" in c.mlp_layer_types else 0,
    position_limit=lambda c: None,  # KDA carries order, the MLA layers use no positions (NoPE)
    image_tokens=lambda c: None,
    builtins=(Builtin(catalog.KIMI_LINEAR_TINY, write_tiny),),
)

__all__ = [
    "FAMILY",
    "KimiDeltaAttention",
    "KimiLinearConfig",
    "KimiLinearForCausalLM",
    "MLAttention",
    "init_kimi_linear",
    "kimi_linear_tiny_config",
    "load_kimi_linear",
    "save_kimi_linear",
    "to_hf",
]
