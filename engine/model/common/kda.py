"""Kimi Delta Attention (KDA): q/k/v projections and short causal convolutions, the per-channel
decay gate (``ForgetGate``), beta, the chunked gated delta rule, a gated RMSNorm per head and
o_proj. Kimi Linear's linear-attention layers and the hybrid's KDA blocks. Names are
transformers' ``kimi_linear`` (one ``conv1d`` over q|k|v, the gate's parameters under
``forget_gate``: the families' Hugging Face adapters convert Kimi's disk layout).

Legend: B batch, T tokens, D hidden, H heads, K head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.common.layers import GatedRMSNorm, Past, autocast_input, f32
from kiln_kernels.conv import short_conv
from kiln_kernels.kda import Gate, kda_chunk
from kiln_kernels.remake import remakeable


class ForgetGate(nn.Module):
    """The per-channel log decay's parts: the low-rank projection (``raw``) and kda_gate's
    parameters (``params``; K3: lower bound -5). KDA's kernels make the decay from them."""

    def __init__(self, hidden: int, H: int, K: int, lower_bound: float | None = None):
        super().__init__()
        self.f_a_proj = nn.Linear(hidden, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.A_log = nn.Parameter(torch.zeros(1, 1, H, 1))
        self.H, self.K, self.lower_bound = H, K, lower_bound

    def raw(self, f_a_BTK: torch.Tensor) -> torch.Tensor:
        """The low-rank projection from its first half's output (``f_a_proj``'s), before the decay
        is made of it: [B, T, H, K]."""
        return low_rank(self.f_b_proj, f_a_BTK).view(*f_a_BTK.shape[:2], self.H, self.K)

    @property
    def params(self) -> Gate:
        return Gate(self.A_log.view(self.H), self.dt_bias.view(self.H, self.K), self.lower_bound)


def low_rank(second: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """A low-rank pair's second projection, ``second(a)``: [.., H*K] from the rank-wide ``a``, so
    remade in the backward from ``a`` rather than kept (``kiln_kernels.remake``), unless it draws
    LoRA dropout (it would not come back the same)."""
    drops = isinstance(getattr(second, "dropout", None), nn.Dropout) and second.training
    return second(a) if drops else remakeable(second, a)


class KimiDeltaAttention(nn.Module):
    """KDA layer: q/k/v projections and short causal convolutions, the decay gate, beta, the
    chunked delta rule, a gated RMSNorm per head and o_proj. ``full_rank_gate`` (K3): the output
    gate is one D x HK projection (``g_proj``) instead of the low-rank g_a/g_b pair.

    ``served_group``: the six projections that read x (``input_projections``) as one, where a
    decode server fused them (engine.inference.adapters.ServedGroup): their outputs in that order."""

    def __init__(
        self,
        hidden: int,
        H: int,
        K: int,
        conv: int = 4,
        eps: float = 1e-5,
        gate_lower_bound: float | None = None,
        full_rank_gate: bool = False,
    ):
        super().__init__()
        D = hidden
        self.served_group: nn.Module | None = None  # set by a decode server
        self.H, self.K = H, K
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, H * K, bias=False) for _ in range(3))
        self.conv1d = nn.Conv1d(3 * H * K, 3 * H * K, conv, groups=3 * H * K, bias=False)
        self.forget_gate = ForgetGate(D, H, K, gate_lower_bound)
        self.b_proj = nn.Linear(D, H, bias=False)
        if full_rank_gate:
            self.g_proj = nn.Linear(D, H * K, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm = GatedRMSNorm(K, eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def input_projections(self) -> tuple[str, ...]:
        gate = "g_proj" if hasattr(self, "g_proj") else "g_a_proj"
        return ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "b_proj", gate)

    def forward(
        self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None, past: Past | None = None
    ) -> torch.Tensor:
        """``past`` (``layers.Past``): the documents continue earlier tokens (another rank's under
        context parallel, a decode's earlier steps): the convolutions read their last tokens and
        the delta rule starts from their state."""
        B, T, _ = x_BTD.shape
        x_BTD = autocast_input(x_BTD)  # read by six projections (one product where a server fused them)
        first = self.served_group(x_BTD) if self.served_group is not None else None
        # q's channels, k's, v's convolved apart in training (no concatenated copy); q and k
        # L2-normalised per head in fp32 (fla's form), all three in the activations' dtype (bf16
        # under autocast: the kernel's products on bf16 tensor cores); the state, the decay and
        # every sum stay fp32
        ins = first[:3] if first is not None else [p(x_BTD) for p in (self.q_proj, self.k_proj, self.v_proj)]
        norms = (self.K, self.K, 0)
        if past is None:
            filters = self.conv1d.weight.split(self.H * self.K)
            qkv = [  # each remade from its projection's output, which the conv keeps
                remakeable(short_conv, y, w, cu_seqlens, norm) for y, w, norm in zip(ins, filters, norms, strict=True)
            ]
        else:  # the three at once: a decode step convolves them as one
            assert cu_seqlens is not None  # a continuation always has its documents' offsets
            qkv = past.conv(ins, self.conv1d.weight, cu_seqlens, norms, (id(self), "conv"))
        del ins  # a forward without grad frees the projections once convolved (training's remake keeps them)
        q, k, v = (y.view(B, T, self.H, self.K) for y in qkv)
        beta = torch.sigmoid(f32(first[4] if first is not None else self.b_proj(x_BTD)))
        # the decay made inside the kernels from the gate's raw projection (kept, not an fp32 decay)
        f_a = first[3] if first is not None else self.forget_gate.f_a_proj(x_BTD)
        raw, gate = self.forget_gate.raw(f_a), self.forget_gate.params
        full, g = hasattr(self, "g_proj"), None
        if first is not None:  # the six are views of one tensor: g taken out of it now, so that it
            g = first[5].clone() if full else low_rank(self.g_b_proj, first[5])  # goes before the delta rule
            del first, f_a
        if past is None:
            o, _ = kda_chunk(q, k, v, raw, beta, cu_seqlens=cu_seqlens, gate=gate)
        else:
            assert cu_seqlens is not None
            o = past.delta_rule(q, k, v, raw, beta, cu_seqlens, (id(self), "S"), gate)
        if g is None:
            g = self.g_proj(x_BTD) if full else low_rank(self.g_b_proj, self.g_a_proj(x_BTD))
        return self.o_proj(self.o_norm(o.to(x_BTD.dtype), g.view(B, T, self.H, self.K)).reshape(B, T, -1))
