"""One typed config for the hybrid family, from a 2-layer debug model to the flagship, that
round-trips through JSON, and parameter counting from the config alone.

The flagship's shape is the public Kimi K3 (NeMo Automodel's kimi_k3 config, the tech report's
Table 1): 93 layers, full attention at every 4th layer and the last (24 of them, 69 KDA), hidden
7168, 96 heads, KDA 96 x 128 with a full-rank output gate and decay lower bound -5, a dense first
layer of width 33792, then LatentMoE with 896 experts (3072 wide, latent 3584, top-16, 2 shared),
SiTU, MLA with q_lora 1536 / kv_lora 512 / NoPE and an output gate, Block AttnRes of 12.
The attention layers here are Gated DSA (MLA + lightning indexer, top-2048).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class KDAConfig:
    heads: int
    head_dim: int
    conv: int = 4
    gate_lower_bound: float | None = None
    full_rank_gate: bool = False


@dataclass
class DSAConfig:
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_dim: int
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    gated: bool = True
    rope: bool = True


@dataclass
class MoEConfig:
    experts: int
    top_k: int
    inter: int
    shared: int = 1  # shared experts, each ``inter`` wide
    latent: int | None = None  # LatentMoE width
    first_dense: int = 1  # the first layers use a dense MLP of ``dense_inter``
    dense_inter: int = 0
    routed_scale: float = 1.0
    groups: int = 1  # DeepSeek's grouped routing: keep the best topk_group groups, then top-k
    topk_group: int = 1


@dataclass
class VisionConfig:
    image_size: int = 32
    patch_size: int = 8
    layers: int = 2  # ViT blocks over the patches
    heads: int = 4


@dataclass
class ModelConfig:
    vocab_size: int
    hidden: int
    layers: int
    kda: KDAConfig
    dsa: DSAConfig
    moe: MoEConfig
    attention_every: int = 4  # a DSA layer every 4th layer (and the last); KDA elsewhere
    activation: str = "swiglu"  # or "situ"
    attn_res: bool = True
    attn_res_block: int = 12  # sublayers per AttnRes block
    vision: VisionConfig | None = None
    rms_eps: float = 1e-5
    max_seq_len: int = 4096
    rope_theta: float = 10000.0

    @property
    def layer_kinds(self) -> list[str]:
        return [
            "dsa" if (i + 1) % self.attention_every == 0 or i == self.layers - 1 else "kda" for i in range(self.layers)
        ]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        vision = VisionConfig(**d.pop("vision")) if d.get("vision") else None
        d.pop("vision", None)
        return cls(
            kda=KDAConfig(**d.pop("kda")),
            dsa=DSAConfig(**d.pop("dsa")),
            moe=MoEConfig(**d.pop("moe")),
            vision=vision,
            **d,
        )

    @classmethod
    def debug(cls, vocab_size: int = 263) -> ModelConfig:
        """Two layers (one KDA, one Gated DSA), every feature on: runs the real loop in seconds."""
        return cls(
            vocab_size=vocab_size,
            hidden=64,
            layers=2,
            kda=KDAConfig(heads=2, head_dim=16, gate_lower_bound=-5.0),
            dsa=DSAConfig(
                heads=2,
                q_lora_rank=32,
                kv_lora_rank=16,
                qk_nope=16,
                qk_rope=8,
                v_dim=16,
                index_heads=2,
                index_head_dim=16,
                index_topk=8,
            ),
            moe=MoEConfig(experts=4, top_k=2, inter=32, shared=1, latent=32, first_dense=1, dense_inter=96),
            activation="situ",
            attn_res=True,
            attn_res_block=2,
            vision=VisionConfig(),
        )

    @classmethod
    def flagship(cls) -> ModelConfig:
        return cls(
            vocab_size=163840,
            hidden=7168,
            layers=93,
            kda=KDAConfig(heads=96, head_dim=128, gate_lower_bound=-5.0, full_rank_gate=True),
            dsa=DSAConfig(
                heads=96,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_nope=128,
                qk_rope=64,
                v_dim=128,
                index_heads=64,
                index_head_dim=128,
                index_topk=2048,
                gated=True,
                rope=False,
            ),
            moe=MoEConfig(experts=896, top_k=16, inter=3072, shared=2, latent=3584, first_dense=1, dense_inter=33792),
            activation="situ",
            attn_res=True,
            attn_res_block=12,
            max_seq_len=1 << 20,
        )


def count_parameters(c: ModelConfig) -> dict[str, int]:
    """Parameters by part, the total, and those active per token (shared, not routed away)."""
    D, k, d, m = c.hidden, c.kda, c.dsa, c.moe
    HK = k.heads * k.head_dim
    kda = (
        3 * D * HK
        + 3 * HK * k.conv
        + D * k.head_dim
        + k.head_dim * HK
        + HK
        + k.heads
        + D * k.heads
        + (D * HK if k.full_rank_gate else D * k.head_dim + k.head_dim * HK)
        + k.head_dim
        + HK * D
    )
    qk = d.qk_nope + d.qk_rope
    dsa = (
        D * d.q_lora_rank
        + d.q_lora_rank
        + d.q_lora_rank * d.heads * qk
        + D * (d.kv_lora_rank + d.qk_rope)
        + d.kv_lora_rank
        + d.kv_lora_rank * d.heads * (d.qk_nope + d.v_dim)
        + d.heads * d.v_dim * D
        + (D * d.heads * d.v_dim if d.gated else 0)
        + d.q_lora_rank * d.index_heads * d.index_head_dim
        + D * d.index_head_dim
        + 2 * d.index_head_dim
        + D * d.index_heads
    )
    width = m.latent or D
    one_expert = 3 * m.inter * width
    moe_fixed = m.experts * D + 3 * D * m.inter * m.shared + ((2 * D * m.latent + m.latent) if m.latent else 0)
    dense = 3 * D * m.dense_inter
    kinds = c.layer_kinds
    n_moe = sum(1 for i in range(c.layers) if i >= m.first_dense)
    parts = {
        "embeddings": 2 * c.vocab_size * D + D,
        "norms": 2 * D * c.layers,
        "kda": kda * kinds.count("kda"),
        "dsa": dsa * kinds.count("dsa"),
        "dense_mlp": dense * (c.layers - n_moe),
        "experts": one_expert * m.experts * n_moe,
        "moe_other": moe_fixed * n_moe,
        "attn_res": (2 * c.layers + 1) * D if c.attn_res else 0,
        "vision": (
            3 * c.vision.patch_size**2 * D
            + D
            + (c.vision.image_size // c.vision.patch_size) ** 2 * D
            + D
            + D * D
            + D
            + c.vision.layers * (2 * D + 3 * D * D + 3 * D + D * D + D + 8 * D * D + 5 * D)
        )
        if c.vision
        else 0,
    }
    total = sum(parts.values())
    return {**parts, "total": total, "active": total - one_expert * (m.experts - m.top_k) * n_moe}
