"""The Kimi hybrid's family (K3's shape): KDA and Gated DSA blocks, (Latent)MoE, Attention
Residuals, an image encoder; sized by engine.config.ModelConfig, saved in Kiln's own layout."""

from __future__ import annotations

from engine.model.family import Builtin, Family
from engine.model.hybrid.builtin import write_tiny
from engine.model.hybrid.hf import build, config_from_json, load_hybrid, save_hybrid
from engine.model.hybrid.model import HybridForCausalLM, experts_of, image_tokens_of, position_limit_of
from kiln import catalog

FAMILY = Family(
    model_type="kiln_hybrid",
    model_class=HybridForCausalLM,
    config=config_from_json,
    build=build,
    load=load_hybrid,
    save=save_hybrid,
    lora=catalog.HYBRID,
    experts=experts_of,
    position_limit=position_limit_of,
    image_tokens=image_tokens_of,
    builtins=(Builtin(catalog.KILN_HYBRID_TINY, write_tiny),),
)

__all__ = ["FAMILY", "HybridForCausalLM", "load_hybrid", "save_hybrid"]
