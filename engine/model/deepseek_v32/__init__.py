"""DeepSeek V3.2's family: its checkpoints load as the hybrid model with every layer Gated DSA
(gate off, RoPE on), grouped sigmoid routing, plain residuals, no vision. No built-in model; a
trained one is saved as a hybrid (``kiln_hybrid``)."""

from __future__ import annotations

from engine.model.deepseek_v32.hf import deepseek_v32_config, load_deepseek_v32
from engine.model.family import Family
from engine.model.hybrid.model import HybridForCausalLM, experts_of, image_tokens_of, position_limit_of
from kiln import catalog

FAMILY = Family(
    model_type="deepseek_v32",
    model_class=HybridForCausalLM,
    config=deepseek_v32_config,
    build=lambda raw: HybridForCausalLM(deepseek_v32_config(raw)),
    load=load_deepseek_v32,
    save=None,
    lora=catalog.DEEPSEEK_V32,
    experts=experts_of,
    position_limit=position_limit_of,
    image_tokens=image_tokens_of,
)

__all__ = ["FAMILY", "deepseek_v32_config", "load_deepseek_v32"]
