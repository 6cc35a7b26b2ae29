"""The planner: memory per device and the layout for a model and a cluster, before any run.

    python -m engine.tools.plan --gpus 512 [--gpu-memory-gb 141] [--tokens 8192] [--lora-rank 16]
    python -m engine.tools.plan --model kimi_linear/config.json --gpus 8 --tokens 262144 [--recompute none]

For the flagship (or ``--model debug`` / a kiln_hybrid config.json): FSDP2 shards every weight
over all ranks, so sharded weights cost the same per device whatever the EP size; the EP size
decides the working set, since FSDP gathers one layer at a time (and prefetches the next) and a
layer's gathered experts are E / ep of them, and so does the traffic: FSDP gathers E / ep experts
a layer over ``edp`` ranks, and the all-to-all moves each token's top-k rows (at the latent
width) to other ranks. From the divisors of gcd(experts, GPUs), the planner picks the EP size
with the least estimated traffic per step among those whose memory fits.

Estimates, in bytes per device, of what the engine holds (weights in ``--weights`` precision;
LoRA factors, their gradients and AdamW's two moments in fp32, sharded; activations: with
recompute, each layer's two block inputs are kept and one layer is live at a time; the logits
and their gradient in fp32, as the unfused loss makes them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig, count_parameters
from engine.model.kimi_linear import KimiLinearConfig

GB = 1e9
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Plan:
    gpus: int
    ep: int
    parts: dict[str, float]  # bytes per device
    capacity: float
    traffic: dict[str, float]  # bytes each device receives per step

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def lora_parameters(c: ModelConfig, rank: int, experts: bool = True) -> int:
    """LoRA factors r * (in + out) on the linear layers named in TARGETS (KDA's q/k/v/o, MLA's
    q_b/kv_b/o, the shared and dense MLPs) and (with ``experts``) every expert's gate/up and
    down projections."""
    D, k, d, m = c.hidden, c.kda, c.dsa, c.moe
    HK = k.heads * k.head_dim
    kda = 3 * (D + HK) + (HK + D)  # q, k, v, o
    qk = d.qk_nope + d.qk_rope
    dsa = (d.q_lora_rank + d.heads * qk) + (d.kv_lora_rank + d.heads * (d.qk_nope + d.v_dim)) + (d.heads * d.v_dim + D)
    kinds = c.layer_kinds
    n_moe = sum(1 for i in range(c.layers) if i >= m.first_dense)
    mlp = 3 * (D + m.inter * m.shared) * n_moe + 3 * (D + m.dense_inter) * (c.layers - n_moe)
    width = m.latent or D
    routed = m.experts * ((width + 2 * m.inter) + (m.inter + width)) * n_moe if experts else 0
    return rank * (kda * kinds.count("kda") + dsa * kinds.count("dsa") + mlp + routed)


def estimate(
    c: ModelConfig,
    gpus: int,
    ep: int,
    tokens: int,
    rank: int,
    weight_bytes: int,
    capacity_gb: float,
    recompute: bool = True,
) -> Plan:
    p = count_parameters(c)
    m, D = c.moe, c.hidden
    width = m.latent or D
    expert_layer = 3 * m.inter * width * m.experts  # one MoE layer's routed experts
    n_moe = sum(1 for i in range(c.layers) if i >= m.first_dense)
    per_layer_dense = (p["total"] - p["embeddings"] - p["experts"]) / c.layers
    largest = max(per_layer_dense, 3 * D * m.dense_inter) + expert_layer / ep
    HK = c.kda.heads * c.kda.head_dim
    live = tokens * (m.top_k * (3 * m.inter + 2 * width) + 12 * HK + 8 * D) * 2  # one layer's activations, bf16
    kept = c.layers * 2 * tokens * D * 2 + (c.layers * 2 // max(c.attn_res_block, 1) + 2) * tokens * D * 2
    parts = {
        "weights (sharded)": p["total"] * weight_bytes / gpus,
        "gathered layers (FSDP, x2 prefetch)": 2 * largest * weight_bytes,
        "LoRA + grads + AdamW (fp32, sharded)": lora_parameters(c, rank, n_moe > 0) * 16 / gpus,
        "activations kept": kept if recompute else live * c.layers,
        "activations of the live layer": 2 * live,
        "logits + their gradient (fp32)": 2 * tokens * c.vocab_size * 4,
    }
    edp = gpus // ep
    passes = 3 if recompute else 2  # forward, backward (and the recompute's forward)
    traffic = {
        "FSDP all-gathers": passes * (p["total"] - p["experts"]) * weight_bytes * (1 - 1 / gpus)
        + passes * n_moe * expert_layer / ep * weight_bytes * (1 - 1 / edp),
        "EP all-to-all": passes * 2 * n_moe * tokens * m.top_k * width * 2 * (1 - 1 / ep),
    }
    return Plan(gpus, ep, parts, capacity_gb * GB, traffic)


def choose(c: ModelConfig, gpus: int, **kw) -> Plan:
    """The EP size with the least traffic among those that fit, else the one closest to fitting."""
    options = [e for e in range(1, math.gcd(c.moe.experts, gpus) + 1) if c.moe.experts % e == 0 and gpus % e == 0]
    plans = [estimate(c, gpus, e, **kw) for e in options]
    fitting = [pl for pl in plans if pl.fits]
    return min(fitting, key=lambda pl: sum(pl.traffic.values())) if fitting else min(plans, key=lambda pl: pl.total)


def fewest_gpus(c: ModelConfig, per_node: int, limit: int = 1 << 16, **kw) -> int | None:
    gpus = per_node
    while gpus <= limit:
        if choose(c, gpus, **kw).fits:
            return gpus
        gpus *= 2
    return None


def report(c: ModelConfig, plan: Plan, per_node: int) -> str:
    edp = plan.gpus // plan.ep
    lines = [
        f"{plan.gpus} GPUs ({math.ceil(plan.gpus / per_node)} nodes of {per_node}), {plan.capacity / GB:.0f} GB each",
        f"layout: FSDP2 over all {plan.gpus} ranks; experts split {plan.ep} ways (EP), each expert shard "
        f"FSDP-sharded over {edp} ranks; {c.moe.experts // plan.ep} of {c.moe.experts} experts a rank per layer"
        + ("; the EP all-to-all stays inside a node" if plan.ep <= per_node else "; the EP all-to-all crosses nodes"),
        "",
        "| per device | GB |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v / GB:.2f} |" for k, v in plan.parts.items()]
    lines += [
        f"| **total** | **{plan.total / GB:.2f}** |",
        "",
        "traffic per step and device: " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.traffic.items()),
        "",
        ("fits" if plan.fits else "does NOT fit") + f": {plan.total / GB:.1f} of {plan.capacity / GB:.0f} GB",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Kimi Linear on one sequence: memory per device for a length, and the context-parallel size


LOSS_CHUNK = 512 << 20  # kiln_kernels.loss.triton.CHUNK_BYTES: the fused loss's logits at most this


def kimi_linear_parameters(c: KimiLinearConfig) -> tuple[int, int]:
    """(all parameters, those kept in fp32 by engine.lora.store_frozen: embeddings, norms, gates)."""
    import torch

    from engine.model.kimi_linear import KimiLinearForCausalLM

    with torch.device("meta"):
        m = KimiLinearForCausalLM(c)
    total = sum(p.numel() for p in m.parameters())
    wide = m.model.embed_tokens.weight.numel() + sum(
        p.numel()
        for n, p in m.named_parameters()
        if "norm" in n or "A_log" in n or "dt_bias" in n or n.endswith("gate.weight")
    )
    return total, wide


def kimi_linear_lora(
    c: KimiLinearConfig,
    rank: int,
    experts: bool,
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
) -> int:
    import torch

    from engine.lora import apply_lora
    from engine.model.kimi_linear import KimiLinearForCausalLM
    from kiln.spec import LoraSpec

    with torch.device("meta"):
        m = KimiLinearForCausalLM(c)
    apply_lora(
        m,
        LoraSpec(
            rank=rank,
            target_modules=list(targets),
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else [],
        ),
    )
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


def kimi_linear_token_bytes(c: KimiLinearConfig, i: int) -> dict[str, int]:
    """What layer ``i`` keeps for the backward, bytes a token, as the engine's ops save it on CUDA
    under bf16 autocast (fp32 residual stream and norms; bf16 activations; KDA's output
    in fp32): ``saved`` without recompute (the norms', the attention block's and the MLP block's),
    ``kept`` under Swap Core's default ``selective`` recompute (the two block inputs, the norms'
    inputs, the kernels' kept outputs) and ``block``, the largest block's saved bytes (live while
    it is recomputed in the backward)."""
    D, f32, bf = c.hidden_size, 4, 2
    norms = 2 * f32 * D  # each RMSNorm keeps its fp32 input
    if c.layer_types[i] == "full_attention":
        H, qk, v = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        attn = bf * D + bf * H * qk + bf * c.kv_lora_rank + bf * H * (qk + v) + bf * 2 * H * v  # x, q, latent, k v, o
        kernel = 0  # one document: SDPA (recomputed); packed: the varlen kernels' o and lse
    else:
        HK, H, K = c.linear_num_heads * c.linear_head_dim, c.linear_num_heads, c.linear_head_dim
        # x (bf16, read by the projections); q k v before their convolutions (after them they are
        # remade in the backward, as are the decay gate's raw projection and the output gate:
        # kiln_kernels.remake), the two low-rank pairs' rank-wide halves they are remade from;
        # KDA's A_qk and inverse (bf16, 64 a head); its output (the norm's input) and the norm's
        # output (o_proj's input), bf16
        kernel = f32 * HK + 2 * bf * 64 * H
        attn = bf * D + 3 * bf * HK + 2 * bf * K + 2 * bf * 64 * H + bf * HK * 2
    k, E = c.num_experts_per_token, c.num_experts
    if c.mlp_layer_types[i] == "sparse":
        I, Is = c.moe_intermediate_size, c.num_shared_experts * c.moe_intermediate_size
        # router scores (fp32); the experts' permuted input, gate/up product and output (bf16); the
        # shared expert's input, gate, up and activation
        mlp = f32 * E + k * (bf * D + bf * 2 * I + bf * D) + bf * D + 3 * bf * Is
    else:
        mlp = bf * D + 3 * bf * c.intermediate_size
    return {"saved": norms + attn + mlp, "kept": norms + 2 * f32 * D + kernel, "block": max(attn, mlp)}


def kimi_linear_memory(
    c: KimiLinearConfig, tokens: int, rank: int = 16, experts: bool = False, recompute: str = "none", cp: int = 1
) -> dict[str, float]:
    """Bytes one device holds at its peak training one sequence of ``tokens`` (a packed row or
    one document) split over ``cp`` ranks, by part. Weights as the trainer stores them on a GPU
    (bf16, fp32 where store_frozen leaves them), LoRA factors with their gradient and AdamW's
    two moments (fp32), both sharded by FSDP over the ``cp`` ranks, the activations as
    kimi_linear_token_bytes counts them, the fused loss's logits chunk and the fp32 gradients of
    the residual stream in flight (three); not the recomputed block's gradients in flight, so it
    reads low under ``selective`` (against the H200's peaks: bench/RESULTS.md, the fourteenth
    session's whole-step section; tests/unit/test_plan.py holds it within 20%)."""
    T = -(-tokens // cp)
    total, wide = kimi_linear_parameters(c)
    weights: float = 2 * (total - wide) + 4 * wide
    if cp > 1:  # FSDP shards them over the ranks, and gathers a layer (and prefetches the next) at a time
        weights = weights / cp + 2 * 2 * (total - 2 * c.vocab_size * c.hidden_size) / c.num_hidden_layers
    layers = [kimi_linear_token_bytes(c, i) for i in range(c.num_hidden_layers)]
    if recompute == "none":
        acts = {"activations kept": T * sum(l["saved"] for l in layers)}
    else:
        acts = {
            "activations kept": T * sum(l["kept"] for l in layers),
            "the block being recomputed": T * max(l["block"] for l in layers),
        }
    D = c.hidden_size
    return {
        "weights": weights,
        "LoRA + grads + AdamW (fp32)": 16 * kimi_linear_lora(c, rank, experts) / cp,
        **acts,
        "loss (logits chunk, dh, h)": min(LOSS_CHUNK, T * c.vocab_size * 2) + 2 * T * D * 2 + T * D * 4,
        "residual gradients (fp32)": 3 * T * D * 4,
    }


def choose_cp(c: KimiLinearConfig, tokens: int, gpus: int, capacity_gb: float, **kw) -> int | None:
    """The fewest ranks, a divisor of ``gpus``, over which a ``tokens`` sequence fits, with Swap
    Core's recompute where no recompute does not fit; None when none does."""
    for cp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        for recompute in ("none", "selective"):
            if sum(kimi_linear_memory(c, tokens, cp=cp, recompute=recompute, **kw).values()) <= capacity_gb * GB:
                return cp
    return None


def load_config(name: str) -> ModelConfig | KimiLinearConfig:
    if name == "flagship":
        return ModelConfig.flagship()
    if name == "debug":
        return ModelConfig.debug()
    raw = json.loads(Path(name).read_text())
    if raw.get("model_type") == "kimi_linear":
        return KimiLinearConfig.from_hf(raw)
    if raw.get("model_type") != "kiln_hybrid":
        raise ValueError(
            f"{name}: the planner reads kiln_hybrid and kimi_linear configs (model_type {raw.get('model_type')!r})"
        )
    return ModelConfig.from_json(json.dumps(raw["model"]))


def kimi_linear_report(
    c: KimiLinearConfig, tokens: int, gpus: int, capacity_gb: float, rank: int, experts: bool
) -> tuple[str, int]:
    """The context-parallel size chosen for a ``tokens`` sequence, its memory by part; exit code."""
    cp = choose_cp(c, tokens, gpus, capacity_gb, rank=rank, experts=experts)
    if cp is None:
        return f"a {tokens:,}-token sequence does not fit on {gpus} GPUs of {capacity_gb:.0f} GB", 1
    recompute = (
        "none"
        if sum(kimi_linear_memory(c, tokens, rank, experts, "none", cp).values()) <= capacity_gb * GB
        else "selective"
    )
    parts = kimi_linear_memory(c, tokens, rank, experts, recompute, cp)
    lines = [
        f"a {tokens:,}-token sequence: parallel.cp_size {cp} ({-(-tokens // cp):,} tokens a rank), "
        f"memory.recompute {recompute}",
        "",
        "| per device | GB |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v / GB:.2f} |" for k, v in parts.items()]
    lines += [f"| **total** | **{sum(parts.values()) / GB:.2f}** of {capacity_gb:.0f} |"]
    return "\n".join(lines), 0


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(
        prog="python -m engine.tools.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a.add_argument("--model", default="flagship", help="flagship, debug, or a kiln_hybrid or kimi_linear config.json")
    a.add_argument("--gpus", type=int, required=True)
    a.add_argument("--gpus-per-node", type=int, default=8)
    a.add_argument("--gpu-memory-gb", type=float, default=141.0, help="H200: 141; H100: 80")
    a.add_argument("--tokens", type=int, default=8192, help="tokens per device per micro-batch")
    a.add_argument("--lora-rank", type=int, default=16)
    a.add_argument("--weights", choices=["bf16", "fp32"], default="bf16")
    a.add_argument("--no-recompute", action="store_true")
    a.add_argument("--expert-lora", action="store_true", help="kimi_linear: LoRA on the experts too")
    args = a.parse_args(argv)
    try:
        c = load_config(args.model)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.gpus < 1:
        print("error: --gpus must be at least 1", file=sys.stderr)
        return 2
    if isinstance(c, KimiLinearConfig):  # one sequence: how many ranks share it (context parallel)
        text, code = kimi_linear_report(c, args.tokens, args.gpus, args.gpu_memory_gb, args.lora_rank, args.expert_lora)
        print(text)
        return code
    kw = dict(
        tokens=args.tokens,
        rank=args.lora_rank,
        weight_bytes=2 if args.weights == "bf16" else 4,
        capacity_gb=args.gpu_memory_gb,
        recompute=not args.no_recompute,
    )
    plan = choose(c, args.gpus, **kw)
    print(
        f"model: {args.model}, {count_parameters(c)['total'] / 1e9:,.1f}B parameters, LoRA rank {args.lora_rank}, "
        f"{args.tokens} tokens per device"
    )
    print(report(c, plan, args.gpus_per_node))
    if not plan.fits:
        need = fewest_gpus(c, args.gpus_per_node, **kw)
        print(
            f"the fewest GPUs that fit: {need}"
            if need
            else "no cluster up to 65,536 GPUs fits: fewer tokens per device"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
