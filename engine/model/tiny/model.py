"""kiln-tiny: the small built-in model (a Llama-style decoder with a patch-embedding image
encoder) that runs the whole service path on a CPU. Module names follow the Hugging Face layout
(``model.layers.N.self_attn.q_proj``) so adapters carry PEFT's key names; on disk (``hf.py``) the
tensors keep those names.

Legend: B batch, T tokens, D hidden, H heads, K head dim, N images, P patches per image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.common.layers import CausalLM, Past, RMSNorm, autocast_input, row_documents
from engine.model.common.vision import VisionTower
from kiln.tokenizer import ByteTokenizer
from kiln_kernels.attention import varlen_attention


@dataclass
class TinyConfig:
    vocab_size: int = ByteTokenizer.vocab_size
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    image_size: int = 32
    patch_size: int = 8
    initializer_range: float = 0.02
    image_token_id: int = cast(int, ByteTokenizer().special("<|image|>"))  # the byte tokenizer has it
    model_type: str = "kiln_tiny"

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def rope(x_BHTK: torch.Tensor, theta: float, positions_BT: torch.Tensor | None) -> torch.Tensor:
    T, K = x_BHTK.shape[-2], x_BHTK.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, K, 2, device=x_BHTK.device, dtype=torch.float32) / K)
    pos = torch.arange(T, device=x_BHTK.device) if positions_BT is None else positions_BT[:, None, :]
    ang = pos.float().unsqueeze(-1) * inv  # [T, K/2] or [B, 1, T, K/2]
    cos, sin = ang.cos().to(x_BHTK.dtype), ang.sin().to(x_BHTK.dtype)
    x1, x2 = x_BHTK[..., : K // 2], x_BHTK[..., K // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        D, self.H, self.theta = c.hidden_size, c.num_attention_heads, c.rope_theta
        self.q_proj, self.k_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)

    def forward(
        self, x_BTD: torch.Tensor, cu: torch.Tensor, positions_BT: torch.Tensor | None, past: Past | None = None
    ) -> torch.Tensor:
        """Causal attention inside each document of the rows laid end to end (``cu``: host offsets).
        ``past`` (layers.Past): the documents continue earlier tokens, whose keys and values
        (RoPE'd at their own positions) it keeps."""
        B, T, D = x_BTD.shape
        x_BTD = autocast_input(x_BTD)

        def heads(t):
            return t.view(B, T, self.H, D // self.H).transpose(1, 2)

        q, k, v = heads(self.q_proj(x_BTD)), heads(self.k_proj(x_BTD)), heads(self.v_proj(x_BTD))
        q, k = rope(q, self.theta, positions_BT), rope(k, self.theta, positions_BT)
        q, k, v = (t.transpose(1, 2).reshape(B * T, self.H, D // self.H) for t in (q, k, v))
        cu_k = None
        if past is not None:
            rows, cu_k = past.keys(torch.cat([k, v], -1).flatten(1), cu, (id(self), "kv"))
            k, v = rows.view(-1, self.H, 2 * (D // self.H)).chunk(2, -1)
        return self.o_proj(varlen_attention(q, k, v, cu, cu_k).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self, x: torch.Tensor, cu: torch.Tensor, positions_BT: torch.Tensor | None, past: Past | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm.for_matmuls(x), cu, positions_BT, past)
        return x + self.mlp(self.post_attention_layernorm.for_matmuls(x))


class TinyCore(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.vision_tower = VisionTower(c.patch_size, c.hidden_size, c.image_tokens, c.rms_norm_eps)
        self.multi_modal_projector = nn.Linear(c.hidden_size, c.hidden_size)


class TinyForCausalLM(CausalLM, nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.model = TinyCore(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.image_tokens, self.image_size = config.image_tokens, config.image_size

    def hidden(
        self,
        input_ids_BT: torch.Tensor,
        pixels_NCHW: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
        past: Past | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, T, D]. Each image fills the next run of image tokens. With
        ``doc_ids_BT`` (packed rows) a token attends only to earlier tokens of its own document;
        ``past`` (layers.Past): the documents continue earlier tokens (a decode step)."""
        x = self.model.embed_tokens(input_ids_BT)
        B, T = input_ids_BT.shape
        cu = row_documents(doc_ids_BT, B, T)
        slots = input_ids_BT == self.config.image_token_id
        n_slots = int(slots.sum())
        if n_slots:
            if pixels_NCHW is None or pixels_NCHW.shape[0] * self.config.image_tokens != n_slots:
                have = 0 if pixels_NCHW is None else pixels_NCHW.shape[0]
                raise ValueError(f"{n_slots} image tokens but {have} images of {self.config.image_tokens} tokens")
            img = self.model.multi_modal_projector(self.model.vision_tower(pixels_NCHW.to(x.dtype)))
            x = x.masked_scatter(slots.unsqueeze(-1), img.reshape(-1, x.shape[-1]).to(x.dtype))
        for layer in self.model.layers:
            x = layer(x, cu, positions_BT, past)
        return self.model.norm(x)


def init_weights(model: TinyForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, std, generator=g)
    for layer in cast("list[Block]", model.model.layers):  # residual branches scaled by depth (GPT-2's rule)
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.weight.data.mul_(1 / math.sqrt(2 * model.config.num_hidden_layers))
