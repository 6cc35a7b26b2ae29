"""The planner: memory per device and the layout for a model and a cluster, before any run.

    python -m engine.parallel.plan --gpus 512 [--gpu-memory-gb 141] [--tokens 8192] [--lora-rank 16]

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


def estimate(c: ModelConfig, gpus: int, ep: int, tokens: int, rank: int, weight_bytes: int,
             capacity_gb: float, recompute: bool = True) -> Plan:
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
    options = [e for e in range(1, math.gcd(c.moe.experts, gpus) + 1)
               if c.moe.experts % e == 0 and gpus % e == 0]
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
    lines = [f"{plan.gpus} GPUs ({math.ceil(plan.gpus / per_node)} nodes of {per_node}), "
             f"{plan.capacity / GB:.0f} GB each",
             f"layout: FSDP2 over all {plan.gpus} ranks; experts split {plan.ep} ways (EP), each expert shard "
             f"FSDP-sharded over {edp} ranks; {c.moe.experts // plan.ep} of {c.moe.experts} experts a rank per layer"
             + ("; the EP all-to-all stays inside a node" if plan.ep <= per_node else
                "; the EP all-to-all crosses nodes"),
             "", "| per device | GB |", "| --- | ---: |"]
    lines += [f"| {k} | {v / GB:.2f} |" for k, v in plan.parts.items()]
    lines += [f"| **total** | **{plan.total / GB:.2f}** |", "",
              "traffic per step and device: " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.traffic.items()), "",
              ("fits" if plan.fits else "does NOT fit") + f": {plan.total / GB:.1f} of {plan.capacity / GB:.0f} GB"]
    return "\n".join(lines)


def load_config(name: str) -> ModelConfig:
    if name == "flagship":
        return ModelConfig.flagship()
    if name == "debug":
        return ModelConfig.debug()
    raw = json.loads(Path(name).read_text())
    if raw.get("model_type") != "kiln_hybrid":
        raise ValueError(f"{name}: the planner reads kiln_hybrid configs (model_type {raw.get('model_type')!r})")
    return ModelConfig.from_json(json.dumps(raw["model"]))


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(prog="python -m engine.parallel.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--model", default="flagship", help="flagship, debug, or a kiln_hybrid config.json")
    a.add_argument("--gpus", type=int, required=True)
    a.add_argument("--gpus-per-node", type=int, default=8)
    a.add_argument("--gpu-memory-gb", type=float, default=141.0, help="H200: 141; H100: 80")
    a.add_argument("--tokens", type=int, default=8192, help="tokens per device per micro-batch")
    a.add_argument("--lora-rank", type=int, default=16)
    a.add_argument("--weights", choices=["bf16", "fp32"], default="bf16")
    a.add_argument("--no-recompute", action="store_true")
    args = a.parse_args(argv)
    try:
        c = load_config(args.model)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.gpus < 1:
        print("error: --gpus must be at least 1", file=sys.stderr)
        return 2
    kw = dict(tokens=args.tokens, rank=args.lora_rank, weight_bytes=2 if args.weights == "bf16" else 4,
              capacity_gb=args.gpu_memory_gb, recompute=not args.no_recompute)
    plan = choose(c, args.gpus, **kw)
    print(f"model: {args.model}, {count_parameters(c)['total'] / 1e9:,.1f}B parameters, LoRA rank {args.lora_rank}, "
          f"{args.tokens} tokens per device")
    print(report(c, plan, args.gpus_per_node))
    if not plan.fits:
        need = fewest_gpus(c, args.gpus_per_node, **kw)
        print(f"the fewest GPUs that fit: {need}" if need else "no cluster up to 65,536 GPUs fits: fewer tokens per device")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
