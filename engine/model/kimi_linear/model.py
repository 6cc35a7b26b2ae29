"""Kimi Linear: KDA blocks and MLA blocks (NoPE) with a sigmoid-routed MoE, single-device.

Module names follow transformers' in-memory ``kimi_linear`` tree (grouped experts:
``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]; one ``conv1d`` over
q|k|v), so adapters made here carry the names PEFT uses on the transformers model; the on-disk
layout (``block_sparse_moe.experts.N.w1``…) is converted in ``hf.py``.

Legend: B batch, T tokens, D hidden, H heads, K head dim, V value dim, E experts, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from engine.model.common.kda import KimiDeltaAttention
from engine.model.common.layers import CausalLM, Past, RMSNorm, absorbed_kv_b, autocast_input, row_documents
from engine.model.common.moe import MLP, MoE, mlp_input
from kiln_kernels.attention import varlen_attention
from kiln_kernels.dispatch import backend


@dataclass
class KimiLinearConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    linear_head_dim: int
    linear_num_heads: int
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = None
    pad_token_id: int | None = None  # kept so a saved config.json reads back in transformers
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, d: dict) -> KimiLinearConfig:
        """From a kimi_linear config.json (both the transformers names and Kimi's own)."""
        alias = {
            "num_local_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_token",
            "n_shared_experts": "num_shared_experts",
            "n_group": "num_expert_group",
            "norm_topk_prob": "moe_renormalize",
        }
        d = {alias.get(k, k): v for k, v in d.items()}
        lin = d.get("linear_attn_config") or {}
        if "layer_types" not in d and lin:  # the hub's own form: 1-based layer lists
            n = d["num_hidden_layers"]
            full = set(lin.get("full_attn_layers", []))
            d["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
            d.setdefault("linear_head_dim", lin.get("head_dim"))
            d.setdefault("linear_num_heads", lin.get("num_heads"))
            d.setdefault("linear_conv_kernel_dim", lin.get("short_conv_kernel_size", 4))
        if "mlp_layer_types" not in d:
            k = d.get("first_k_dense_replace", 1)
            d["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(d["num_hidden_layers"])]
        if d.get("q_lora_rank") is not None:
            raise ValueError("q_lora_rank is not supported yet (Kimi Linear checkpoints have none)")
        if "full_attention" not in d["layer_types"]:
            raise ValueError("layer_types needs at least one full_attention layer")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class MLAttention(nn.Module):
    """Multi-head latent attention without positional encoding (Kimi Linear's full attention),
    causal inside each document of the sequence (``kiln_kernels.attention``: no [T, T] mask)."""

    def __init__(self, c: KimiLinearConfig):
        super().__init__()
        self.H, self.nope, self.rope, self.v = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.rank = c.kv_lora_rank
        D = c.hidden_size
        self.q_proj = nn.Linear(D, self.H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.H * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(self.H * self.v, D, bias=False)

    def forward(self, x_1TD: torch.Tensor, cu_seqlens: torch.Tensor, past: Past | None = None) -> torch.Tensor:
        """x: one sequence [1, T, D] (rows laid end to end); ``cu_seqlens``: its documents' host
        offsets. ``past``: the documents continue earlier tokens, whose latent rows the keys are
        made from too."""
        T = x_1TD.shape[1]
        x_1TD = autocast_input(x_1TD)
        q = self.q_proj(x_1TD).view(T, self.H, -1)
        latent, k_shared = self.kv_a_proj_with_mqa(x_1TD).split([self.rank, self.rope], -1)
        latent, cu_k = self.kv_a_layernorm(latent), None
        scale = (self.nope + self.rope) ** -0.5
        up = down = None  # decoding: kv_b_proj as W_UK and W_UV, for the absorbed form
        if past is not None:  # MLA's compressed row, rank + rope wide: the small thing to keep or gather
            new_rows = torch.cat([latent, k_shared.to(latent.dtype)], -1)[0]
            up, down = self._absorbed() if not torch.is_grad_enabled() else (None, None)
            step = past.step_keys(new_rows, (id(self), "kv")) if up is not None else None
            if step is not None and up is not None and down is not None:  # a decode step, any device
                o = self._absorbed_step(q, up, down, *step, scale)
                return self.o_proj(o.reshape(1, T, -1))
            rows, cu_k = past.keys(new_rows, cu_seqlens, (id(self), "kv"))
            latent, k_shared = rows[None].split([self.rank, self.rope], -1)
        S = latent.shape[1]
        # a decoder's prefill on the CPU: the absorbed form (the queries taken into the latent space,
        # the latent every head's keys and values) where it pays; CUDA's attention kernels take the
        # per-head form's head dims (the absorbed 576 / 512 they do not)
        if (
            up is not None
            and down is not None
            and backend(x_1TD) == "reference"
            and self._absorbing_pays(T, len(cu_seqlens) - 1)
        ):
            q_nope, q_rope = q.split([self.nope, self.rope], -1)
            qa = torch.cat([torch.einsum("thn,hnr->thr", q_nope, up.to(q_nope.dtype)), q_rope], -1)
            rows = torch.cat([latent, k_shared.to(latent.dtype)], -1)[0].to(qa.dtype)  # cast, then share
            k, v = rows[:, None].expand(S, self.H, -1), rows[:, None, : self.rank].expand(S, self.H, -1)
            o = varlen_attention(qa, k, v, cu_seqlens, cu_k, scale=scale)
            o = torch.einsum("thr,hvr->thv", o, down.to(o.dtype))
            return self.o_proj(o.reshape(1, T, -1))
        kv = self.kv_b_proj(latent).view(S, self.H, -1)
        k_nope, v = kv.split([self.nope, self.v], -1)
        k = torch.cat([k_nope, k_shared.view(S, 1, self.rope).expand(S, self.H, self.rope).to(k_nope.dtype)], -1)
        o = varlen_attention(q, k, v, cu_seqlens, cu_k, scale=scale)
        return self.o_proj(o.reshape(1, T, -1))

    def _absorbed(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return absorbed_kv_b(self.kv_b_proj, self.H, self.nope, self.v, self.rank)

    def _absorbed_step(
        self, q_NHD: torch.Tensor, up: torch.Tensor, down: torch.Tensor, rows_NSC: torch.Tensor, valid_NS, scale: float
    ) -> torch.Tensor:
        """A decode step in the absorbed form (a query a document; ``past.step_keys``' padded key
        rows): each query against its own document's latent rows, all heads in one product. The
        scores and softmax in fp32 at least (from fp32 operands: bf16 scores lost 5-7x the accuracy
        on peaked attention), the probabilities' product with the rows in the rows' dtype (as a
        flash kernel takes them); autocast off, whatever the caller's. Returns [N, H, v]."""
        q_nope, q_rope = q_NHD.split([self.nope, self.rope], -1)
        wide = torch.promote_types(rows_NSC.dtype, torch.float32)
        with torch.autocast(rows_NSC.device.type, enabled=False):
            qa = torch.cat([torch.einsum("thn,hnr->thr", q_nope, up.to(q_nope.dtype)), q_rope], -1)
            s = torch.bmm(qa.to(wide), rows_NSC.to(wide).transpose(1, 2)) * scale  # [N, H, S]
            p = s.masked_fill(~valid_NS[:, None], float("-inf")).softmax(-1).to(rows_NSC.dtype)
            o = torch.bmm(p, rows_NSC[..., : self.rank])  # [N, H, rank]
            return torch.einsum("thr,hvr->thv", o, down.to(o.dtype))

    def _absorbing_pays(self, T: int, docs: int) -> bool:
        """The absorbed form spends (2 rank - nope - v) more multiply-adds per query and key than
        the per-head one and saves kv_b_proj's (nope + v) rank per key: it pays while a document's
        queries are fewer than their ratio (a decode step's one; not a prefill's hundreds)."""
        return T * max(2 * self.rank - self.nope - self.v, 0) < docs * (self.nope + self.v) * self.rank


class DecoderLayer(nn.Module):
    def __init__(self, c: KimiLinearConfig, i: int):
        super().__init__()
        self.kind = c.layer_types[i]
        self.self_attn = (
            MLAttention(c)
            if self.kind == "full_attention"
            else KimiDeltaAttention(
                c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim, c.rms_norm_eps
            )
        )
        self.mlp = (
            MoE(
                c.hidden_size,
                c.num_experts,
                c.num_experts_per_token,
                c.moe_intermediate_size,
                c.num_shared_experts * c.moe_intermediate_size,
                groups=c.num_expert_group,
                topk_group=c.topk_group,
                renorm=c.moe_renormalize,
                scale=c.routed_scaling_factor,
            )
            if c.mlp_layer_types[i] == "sparse"
            else MLP(c.hidden_size, c.intermediate_size)
        )
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x_1TD: torch.Tensor, cu_seqlens: torch.Tensor, past: Past | None = None) -> torch.Tensor:
        x = x_1TD + self.self_attn(self.input_layernorm.for_matmuls(x_1TD), cu_seqlens, past)
        return x + self.mlp(mlp_input(self.post_attention_layernorm, self.mlp, x))


class KimiLinearCore(nn.Module):
    def __init__(self, c: KimiLinearConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class KimiLinearForCausalLM(CausalLM, nn.Module):
    supports_context_parallel = True

    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.config = config
        self.model = KimiLinearCore(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def hidden(
        self,
        input_ids_BT: torch.Tensor,
        pixels_NCHW: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
        past: Past | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, T, D]. The rows are laid end to end as one sequence, cut
        into documents: the rows, or with ``doc_ids_BT`` (packed rows) every document, each
        starting afresh (a KDA state and a convolution per document, attention inside it). No
        positions: KDA carries order and the MLA layers use none (NoPE). ``past`` (layers.Past):
        the documents continue earlier tokens (a context-parallel rank's slice, a decode step)."""
        if pixels_NCHW is not None and pixels_NCHW.numel():
            raise ValueError("Kimi Linear takes no image input")
        B, T = input_ids_BT.shape
        cu = row_documents(doc_ids_BT, B, T)
        x = self.model.embed_tokens(input_ids_BT.reshape(1, B * T))
        for layer in self.model.layers:
            x = layer(x, cu, past)
        return self.model.norm(x).view(B, T, -1)
