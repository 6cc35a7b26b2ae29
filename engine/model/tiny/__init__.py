"""kiln-tiny's family: a small Llama-style decoder with a patch-embedding image encoder."""

from __future__ import annotations

from engine.model.family import Builtin, Family
from engine.model.tiny.builtin import write_tiny
from engine.model.tiny.hf import config_from_json, load_pretrained, save_pretrained
from engine.model.tiny.model import TinyConfig, TinyForCausalLM, init_weights
from kiln import catalog

FAMILY = Family(
    model_type="kiln_tiny",
    model_class=TinyForCausalLM,
    config=config_from_json,
    build=lambda raw: TinyForCausalLM(config_from_json(raw)),
    load=load_pretrained,
    save=save_pretrained,
    lora=catalog.TINY,
    experts=lambda c: 0,
    position_limit=lambda c: c.max_position_embeddings,
    image_tokens=lambda c: c.image_tokens,
    builtins=(Builtin(catalog.KILN_TINY, write_tiny),),
)

__all__ = ["FAMILY", "TinyConfig", "TinyForCausalLM", "init_weights", "load_pretrained", "save_pretrained"]
