"""Gated DeepSeek Sparse Attention: MLA (DeepSeek V3's, with RoPE on the rope dims) whose keys
are chosen per query by the lightning indexer, plus an output gate (K3's gated MLA:
attention output * sigmoid(g_proj(x)) before o_proj; ``gated=False`` is DeepSeek V3.2).

Names follow transformers' ``deepseek_v32`` (``q_a_proj``, ``indexer.wq_b``, ...), so its
weights load as they are. The indexer learns only from its KL loss (``last_indexer_loss``,
recorded while training where the indexer has trainable parameters): its input is detached
from the main model.

The attention runs in MLA's absorbed form, as DeepSeek's sparse kernels do: ``kv_b_proj``'s key
half is folded into the queries (q_h W_UK,h against the shared latent) and its value half applied
after the attention, so all heads share one key/value row of kv_lora_rank + qk_rope dims per
token. Exactly the same sums; one gathered row serves every head. With LoRA dropout on
``kv_b_proj`` (a different input for the factors) it runs per head instead.

Legend: B batch, T tokens, D hidden, H heads, J index heads.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.common.layers import Past, RMSNorm, absorbed_kv_b, autocast_input, doc_starts
from kiln_kernels.dsa import indexer_topk, sparse_attention


def rope_cos_sin(positions_BT: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions_BT.device, dtype=torch.float64) / dim)
    ang = positions_BT[..., None].double() * inv  # [B, T, dim/2]
    return ang.cos(), ang.sin()


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+dim/2}): the indexer's layout."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_{2i}, x_{2i+1}), output de-interleaved: DeepSeek MLA's layout."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int):
        super().__init__()
        self.J, self.Dh, self.rope = heads, head_dim, rope_dim
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def forward(self, x_BTD, q_resid_BTR, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The index queries [B, T, J, d], keys [B, T, d] and head weights [B, T, J]."""
        B, T, _ = x_BTD.shape
        q = self.wq_b(q_resid_BTR).view(B, T, self.J, self.Dh)
        k = self.k_norm(self.wk(x_BTD))
        if cos is not None:  # NoPE models (K3) leave the indexer unrotated too
            q = torch.cat([rope_half(q[..., : self.rope], cos[:, :, None], sin[:, :, None]), q[..., self.rope :]], -1)
            k = torch.cat([rope_half(k[..., : self.rope], cos, sin), k[..., self.rope :]], -1)
        w = self.weights_proj(x_BTD) * self.J**-0.5
        return q, k.to(q.dtype), w.to(q.dtype)


class GatedDSAttention(nn.Module):
    # read as matrices (``_absorbed``: W + B A, then one bf16 cast), not only through their
    # forward: engine.lora.store_frozen leaves them in fp32, where that sum rounds once
    weights_read = ("kv_b_proj",)

    def __init__(
        self,
        hidden: int,
        heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope: int,
        qk_rope: int,
        v_dim: int,
        index_heads: int,
        index_head_dim: int,
        index_topk: int,
        rope_theta: float = 10000.0,
        eps: float = 1e-6,
        gated: bool = True,
        rope: bool = True,
    ):
        super().__init__()
        self.H, self.nope, self.rope, self.v, self.rank = heads, qk_nope, qk_rope, v_dim, kv_lora_rank
        self.topk, self.theta, self.use_rope = index_topk, rope_theta, rope  # rope=False: K3's NoPE
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * (qk_nope + qk_rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (qk_nope + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=False)
        self.g_proj = nn.Linear(hidden, heads * v_dim, bias=False) if gated else None
        self.indexer = Indexer(hidden, q_lora_rank, index_heads, index_head_dim, qk_rope)
        self.last_indexer_loss: torch.Tensor | None = None

    def forward(
        self,
        x_BTD: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        past: Past | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``past`` (layers.Past): x's documents continue earlier tokens (another rank's, a
        decode's earlier steps); the keys (the latent rows, RoPE'd key dims and the indexer's
        keys, one row a token) are theirs and x's, each document's queries the last of its keys.
        ``cu_seqlens``: the documents' host offsets, as the model found them (one row; None: the
        row is one document)."""
        B, T, _ = x_BTD.shape
        x_BTD = autocast_input(x_BTD)
        pos = positions_BT if positions_BT is not None else torch.arange(T, device=x_BTD.device).expand(B, T)
        docs = doc_ids_BT.to(x_BTD.device) if doc_ids_BT is not None else None  # (a decode's stay on the host)
        starts = doc_starts(docs, B, T, x_BTD.device)
        q_resid = self.q_a_layernorm(self.q_a_proj(x_BTD))
        q_nope, q_rot = self.q_b_proj(q_resid).view(B, T, self.H, -1).split([self.nope, self.rope], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x_BTD).split([self.rank, self.rope], -1)
        cos = sin = None
        if self.use_rope:
            cos, sin = rope_cos_sin(pos, self.rope, self.theta)
            q_rot = rope_interleaved(q_rot, cos[:, :, None], sin[:, :, None])
            k_rot = rope_interleaved(k_rot, cos, sin)
        latent = self.kv_a_layernorm(latent)
        index_q, index_k, index_w = self.indexer(
            x_BTD.detach(), q_resid.detach(), cos, sin
        )  # learns from its loss only
        if past is None:
            idx = indexer_topk(index_q.detach(), index_k.detach(), index_w.detach(), starts, self.topk)
        else:
            assert B == 1  # a continuation is one row of documents
            cu = cu_seqlens if cu_seqlens is not None else torch.tensor([0, T])
            widths = [self.rank, self.rope, index_k.shape[-1]]
            rows = torch.cat([latent, k_rot.to(latent.dtype), index_k.to(latent.dtype)], -1)[0]
            rows, cu_k = past.keys(rows, cu, (id(self), "kv"))
            latent, k_rot, index_k = rows[None].split(widths, -1)
            k_rot, index_k = k_rot.to(q_rot.dtype), index_k.to(index_q.dtype)
            idx = past.topk(index_q.detach(), index_k.detach(), index_w.detach(), starts, cu, cu_k, self.topk)
        S = latent.shape[1]
        scale = (self.nope + self.rope) ** -0.5
        # the indexer's target and KL loss only where it can learn from them (full training, or
        # LoRA on its projections): a frozen indexer's loss has no gradient at all
        learns = self.training and any(p.requires_grad for p in self.indexer.parameters())
        indexer = (index_q, index_k, index_w) if learns else None
        up, down = self._absorbed()
        if up is not None:  # keys and values: the latent, shared by all heads
            assert down is not None  # _absorbed gives both or neither
            q = torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, up.to(q_nope.dtype)), q_rot], -1)
            k = torch.cat([latent, k_rot], -1)[:, :, None].to(q.dtype)
            # the values: a view of the keys' latent dims, which the kernel reads once for both
            o, self.last_indexer_loss = self._attend(q, k, k[..., : self.rank], idx, scale, indexer)
            o = torch.einsum("bthr,hvr->bthv", o, down.to(o.dtype))
        else:
            k_nope, v = self.kv_b_proj(latent).view(B, S, self.H, -1).split([self.nope, self.v], -1)
            q = torch.cat([q_nope, q_rot], -1)
            k = torch.cat([k_nope, k_rot[:, :, None].expand(B, S, self.H, self.rope)], -1)
            o, self.last_indexer_loss = self._attend(q, k, v, idx, scale, indexer)
        o = o.reshape(B, T, -1)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o)

    def _attend(self, q, k, v, idx, scale, indexer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention, and with ``indexer`` (its q, k, w) the indexer's KL loss (whose value the
        kernels write in the backward)."""
        if indexer is not None:
            return sparse_attention(q, k, v, idx, scale, indexer)
        return sparse_attention(q, k, v, idx, scale), None

    def _absorbed(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``layers.absorbed_kv_b`` of this layer's ``kv_b_proj``."""
        return absorbed_kv_b(self.kv_b_proj, self.H, self.nope, self.v, self.rank)
