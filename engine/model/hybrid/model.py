"""The Kimi hybrid model: KDA and Gated DSA blocks by a pattern, (Latent)MoE, Attention
Residuals, a small image encoder for ``<image>`` tokens. Single-device code; sized by
engine.config.ModelConfig from the debug model to the flagship.

Legend: B batch, T tokens, D hidden, N images.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.common.attnres import AttnResQueries, Residuals
from engine.model.common.dsa import GatedDSAttention
from engine.model.common.kda import KimiDeltaAttention
from engine.model.common.layers import CausalLM, Past, RMSNorm, cu_seqlens, rows_end_to_end
from engine.model.common.moe import MLP, MoE, mlp_input
from engine.model.common.vision import VisionTower


def image_tokens_of(c: ModelConfig) -> int | None:
    """Tokens an image fills (its patches); None: no image encoder."""
    v = c.vision
    return (v.image_size // v.patch_size) ** 2 if v else None


def position_limit_of(c: ModelConfig) -> int | None:
    """The longest sequence the positions allow: RoPE's ``max_seq_len``; None without RoPE (K3's
    NoPE attention: KDA carries order), any length that fits."""
    return c.max_seq_len if c.dsa.rope else None


def experts_of(c: ModelConfig) -> int:
    """Routed experts per MoE layer; 0 where every layer is dense."""
    return c.moe.experts if c.layers > c.moe.first_dense else 0


class HybridLayer(nn.Module):
    def __init__(self, c: ModelConfig, i: int):
        super().__init__()
        self.kind = c.layer_kinds[i]
        k, d, m = c.kda, c.dsa, c.moe
        self.self_attn: KimiDeltaAttention | GatedDSAttention
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(
                c.hidden, k.heads, k.head_dim, k.conv, c.rms_eps, k.gate_lower_bound, k.full_rank_gate
            )
        else:
            self.self_attn = GatedDSAttention(
                c.hidden,
                d.heads,
                d.q_lora_rank,
                d.kv_lora_rank,
                d.qk_nope,
                d.qk_rope,
                d.v_dim,
                d.index_heads,
                d.index_head_dim,
                d.index_topk,
                rope_theta=c.rope_theta,
                eps=c.rms_eps,
                gated=d.gated,
                rope=d.rope,
            )
        self.mlp = (
            MLP(c.hidden, m.dense_inter, c.activation)
            if i < m.first_dense
            else MoE(
                c.hidden,
                m.experts,
                m.top_k,
                m.inter,
                m.shared * m.inter,
                latent=m.latent,
                act=c.activation,
                eps=c.rms_eps,
                scale=m.routed_scale,
                groups=m.groups,
                topk_group=m.topk_group,
            )
        )
        self.input_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.rms_eps)

    def forward(
        self,
        res: Residuals,
        i: int,
        cu: torch.Tensor | None,
        positions_BT: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None,
        past: Past | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``: attention, then the MLP, each reading its AttnRes site and adding its output
        to ``res``. Returns both outputs (FSDP's hooks need the block to return what it made).
        ``past`` (layers.Past): the documents continue earlier tokens."""
        h = self.input_layernorm.for_matmuls(res.input(2 * i))
        a = self.self_attn(h, cu, past) if self.kind == "kda" else self.self_attn(h, positions_BT, doc_ids_BT, past, cu)
        res.add(a)
        m = self.mlp(mlp_input(self.post_attention_layernorm, self.mlp, res.input(2 * i + 1)))
        res.add(m)
        return a, m


class HybridForCausalLM(CausalLM, nn.Module):
    supports_context_parallel = True

    def __init__(self, config: ModelConfig, image_token_id: int | None = None):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(HybridLayer(c, i) for i in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.rms_eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        self.attn_res = AttnResQueries(2 * c.layers + 1, c.hidden) if c.attn_res else None
        self.image_token_id = image_token_id
        if c.vision:
            tokens = (c.vision.image_size // c.vision.patch_size) ** 2
            self.vision_tower = VisionTower(
                c.vision.patch_size, c.hidden, tokens, c.rms_eps, c.vision.layers, c.vision.heads
            )
            self.multi_modal_projector = nn.Linear(c.hidden, c.hidden)

    @property
    def image_tokens(self) -> int | None:
        return image_tokens_of(self.config)

    @property
    def image_size(self) -> int:
        return self.config.vision.image_size if self.config.vision else 0

    def indexer_loss(self) -> torch.Tensor | None:
        """The DSA indexers' KL losses of the last training forward, summed (None in eval, and
        where no indexer has a trainable parameter: LoRA that leaves them out): a term for the
        backward. On the kernels its value is NaN (each layer's ``last_indexer_loss`` has its
        value once the backward has run: its target comes from the attention's backward)."""
        losses = [
            l.self_attn.last_indexer_loss
            for l in cast("list[HybridLayer]", self.layers)
            if isinstance(l.self_attn, GatedDSAttention) and l.self_attn.last_indexer_loss is not None
        ]
        return torch.stack(losses).sum() if losses else None

    def hidden(
        self,
        input_ids_BT: torch.Tensor,
        pixels_NCHW: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
        past: Past | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, T, D]. ``past`` (layers.Past): the one row's documents
        continue earlier tokens (a context-parallel rank's slice, text only; a decode step)."""
        B, T = input_ids_BT.shape
        if doc_ids_BT is not None and B > 1:  # rows end to end: one KDA state per document
            pos = positions_BT.reshape(1, B * T) if positions_BT is not None else None
            return self.hidden(input_ids_BT.reshape(1, B * T), pixels_NCHW, rows_end_to_end(doc_ids_BT), pos).view(
                B, T, -1
            )
        x = self.embed_tokens(input_ids_BT)
        if pixels_NCHW is not None and pixels_NCHW.numel():
            if self.config.vision is None:
                raise ValueError("this model takes no image input")
            assert self.image_token_id is not None  # a model with a vision tower has its image token
            slots = input_ids_BT == self.image_token_id
            img = self.multi_modal_projector(self.vision_tower(pixels_NCHW.to(x.dtype)))
            x = x.masked_scatter(slots.unsqueeze(-1), img.reshape(-1, x.shape[-1]).to(x.dtype))
        cu = cu_seqlens(doc_ids_BT) if doc_ids_BT is not None else None
        res = Residuals(x, self.attn_res, self.config.attn_res_block)
        for i, layer in enumerate(self.layers):
            layer(res, i, cu, positions_BT, doc_ids_BT, past)
        return self.norm(res.input(2 * len(self.layers)))
