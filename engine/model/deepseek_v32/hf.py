"""DeepSeek V3.2 checkpoints as a hybrid model: every layer Gated DSA with the gate off and RoPE
on. Names on disk are the module names under ``model.`` (experts one by one: DeepSeek's
``gate_proj`` / ``up_proj`` / ``down_proj``, stacked on load). Loaded only: a trained model is
saved in the hybrid's own layout (``engine.model.hybrid.hf``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import DSAConfig, KDAConfig, ModelConfig, MoEConfig
from engine.model.common.hf import ExpertStacker, check_complete, stream_into
from engine.model.hybrid.model import HybridForCausalLM


def deepseek_v32_config(d: dict) -> ModelConfig:
    """A DeepSeek V3.2 config.json as a hybrid config: every layer Gated DSA with the gate off
    and RoPE on, grouped sigmoid routing, plain residuals, no vision."""
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported yet (only 'default')")
    first_dense = d.get("first_k_dense_replace", 0)
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden=d["hidden_size"],
        layers=d["num_hidden_layers"],
        kda=KDAConfig(heads=1, head_dim=1),
        attention_every=1,
        dsa=DSAConfig(
            heads=d["num_attention_heads"],
            q_lora_rank=d["q_lora_rank"],
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope=d["qk_nope_head_dim"],
            qk_rope=d["qk_rope_head_dim"],
            v_dim=d["v_head_dim"],
            index_heads=d["index_n_heads"],
            index_head_dim=d["index_head_dim"],
            index_topk=d["index_topk"],
            gated=False,
            rope=True,
        ),
        moe=MoEConfig(
            experts=d["n_routed_experts"],
            top_k=d["num_experts_per_tok"],
            inter=d["moe_intermediate_size"],
            shared=d.get("n_shared_experts", 0),
            first_dense=first_dense,
            dense_inter=d["intermediate_size"],
            routed_scale=d.get("routed_scaling_factor", 1.0),
            groups=d.get("n_group", 1),
            topk_group=d.get("topk_group", 1),
        ),
        activation="swiglu",
        attn_res=False,
        rms_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", 10000.0),
        max_seq_len=d.get("max_position_embeddings", 4096),
    )


def load_deepseek_v32(folder: str | Path, dtype: torch.dtype = torch.float32) -> HybridForCausalLM:
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    if not raw.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=False is not supported")
    config = deepseek_v32_config(raw)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    experts = ExpertStacker(config.moe.experts, config.moe.inter, dtype)
    check_complete(model, folder, stream_into(model, folder, dtype, experts, lambda key, t: key.removeprefix("model.")))
    return model
