"""Mixture of experts: the router (sigmoid scores, top-k, aux-loss-free bias balancing), grouped
expert weights (one tensor per projection), shared experts, and K3's LatentMoE (experts work in
a narrower latent space: down-projection, experts, RMSNorm, up-projection) with the SiTU
activation. Names are transformers' (``gate``, ``experts.gate_up_proj``, ``shared_experts``).

Legend: N tokens, D hidden, E experts, I expert width, K experts per token, Z latent width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.common.layers import RMSNorm, autocast_input, f32
from engine.model.common.recompute import recomputing
from kiln_kernels.dispatch import backend, impl
from kiln_kernels.moe import Lora, grouped_mlp
from kiln_kernels.moe.reference import (
    every_expert,
    every_expert_suits,
    swiglu,  # kiln_kernels.moe.grouped fuses it
)


def situ(gate: torch.Tensor, up: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    """K3's bounded SwiGLU: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)."""
    return b1 * torch.tanh(gate / b1) * torch.sigmoid(gate) * (b2 * torch.tanh(up / b2))


ACTIVATIONS = {"swiglu": swiglu, "situ": situ}


class MLP(nn.Module):
    """``served_group``: gate_proj and up_proj as one, where a decode server fused them
    (engine.inference.adapters.ServedGroup)."""

    def __init__(self, D: int, inter: int, act: str = "swiglu"):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, inter, bias=False), nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)
        self.act = ACTIVATIONS[act]
        self.served_group: nn.Module | None = None  # set by a decode server

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        gate, up = self.served_group(x) if self.served_group is not None else (self.gate_proj(x), self.up_proj(x))
        if self.act is swiglu:  # fused on CUDA: one pass each way, silu(gate) not kept
            return self.down_proj(impl("swiglu", gate, up).swiglu(gate, up))
        return self.down_proj(self.act(gate, up))

    def input_projections(self) -> tuple[str, ...]:
        return ("gate_proj", "up_proj")


def counts_of(sorted_ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each id of 0..n-1 occurs in a sorted 1-D tensor, [n] int64: bincount without a
    host sync (CUDA's bincount reads the largest id back to size its output, and the queue of
    kernels ran dry at every MoE forward and recompute)."""
    edges = torch.arange(n + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, edges).diff()


class Router(nn.Module):
    """Sigmoid scores; the bias (aux-loss-free balancing) only chooses, the scores weigh."""

    e_score_correction_bias: torch.Tensor  # a buffer (registered in __init__)

    def __init__(
        self, D: int, E: int, k: int, groups: int = 1, topk_group: int = 1, renorm: bool = True, scale: float = 1.0
    ):
        super().__init__()
        self.E, self.k, self.groups, self.topk_group, self.renorm, self.scale = E, k, groups, topk_group, renorm, scale
        self.weight = nn.Parameter(torch.zeros(E, D))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.load: torch.Tensor | None = None  # tokens per expert, counted while training

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_autocast_enabled(x_ND.device.type):  # fp32 scores under bf16 autocast too: the
            with torch.autocast(x_ND.device.type, enabled=False):  # choice of experts must not round away
                return self.forward(x_ND)
        scores = F.linear(f32(x_ND), f32(self.weight)).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.groups > 1:
            grouped = choice.view(-1, self.groups, self.E // self.groups)
            best = grouped.topk(2, -1)[0].sum(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, -1)[1], 1.0).bool()
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, self.E)  # whole groups at once
        idx = choice.topk(self.k, -1, sorted=False)[1]
        if self.training and not recomputing():  # tokens per expert since the last balancing update
            counts = counts_of(idx.flatten().sort()[0], self.E)
            self.load = counts if self.load is None else self.load + counts
        w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek V3 / K3): raise the bias of under-used experts and
        lower the over-used, by ``rate`` each, mean-free; the bias only chooses, never weighs."""
        if self.load is None:
            return
        load = self.load.float()
        db = rate * torch.sign(load.mean() - load)
        self.e_score_correction_bias += (db - db.mean()).to(self.e_score_correction_bias.dtype)
        self.load = None


class Experts(nn.Module):
    """Grouped expert weights, one tensor per projection."""

    def __init__(self, E: int, D: int, I: int, act: str = "swiglu"):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, I))
        self.act = ACTIVATIONS[act]

    def grouped(self, x_MD: torch.Tensor, counts_E: torch.Tensor, w_M: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert (an index into this module's tensors) on its rows, each row weighed by
        ``w_M`` (its routing weight): the rows come grouped by expert, ``counts_E`` of each
        (kiln_kernels.moe: a loop on the CPU, grouped GEMMs on CUDA)."""
        return grouped_mlp(x_MD, counts_E, self.gate_up_proj, self.down_proj, self.act, *self._adapter(), w_M)

    def _adapter(self) -> tuple[Lora | None, float]:
        """The LoRA factors and scaling on the experts (``lora``: engine.lora.ExpertsLoRA when
        fine-tuning them, a served adapter's in engine.inference.adapters), else None and 1."""
        lora = getattr(self, "lora", None)
        return (lora.factors(), lora.scaling) if lora is not None else (None, 1.0)

    def forward(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """Sort the (token, slot) pairs by expert (stable: tokens ascending within an expert), run
        the experts (they weigh their rows: the weight scales the activation, before the down
        projection), add back into the tokens (expert by expert, as a loop would). The rows are
        cast (under autocast) before they are copied k times: k times fewer casts each way. A
        decode step's few tokens on the reference: every expert on every token, no sort
        (``every_expert``)."""
        x_in = autocast_input(x_ND)
        if backend(x_ND) == "reference" and every_expert_suits(idx_NK, self.gate_up_proj):
            W1, W2 = self.gate_up_proj, self.down_proj
            return every_expert(x_in, idx_NK, w_NK, W1, W2, self.act, *self._adapter()).to(x_ND.dtype)
        flat = idx_NK.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // idx_NK.shape[1]
        counts = counts_of(flat[order], self.gate_up_proj.shape[0])
        w_M = w_NK.reshape(-1)[order]  # the router's fp32 weights
        if backend(x_ND) != "reference":  # Triton (CUDA, Ascend): a token sums its k rows in one program
            moe_kernels = impl("moe_permute", x_ND)

            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=order.device)
            inv = inv.view_as(idx_NK)
            y = self.grouped(moe_kernels.permute(x_in, tok, inv), counts, w_M)
            return moe_kernels.unpermute(y, inv).to(x_ND.dtype)  # fp32 sums
        y = self.grouped(x_in[tok], counts, w_M)
        return torch.zeros_like(x_ND).index_add_(0, tok, y.to(x_ND.dtype))


def mlp_input(norm: RMSNorm, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The post-attention norm of x as the MLP block reads it: fp32 for an MoE (its router's
    choice of experts must not round away), else in autocast's dtype (only matmuls read it)."""
    return norm(x) if isinstance(mlp, MoE) else norm.for_matmuls(x)


class MoE(nn.Module):
    """Routed experts plus shared experts. With ``latent``: y = W_up RMSNorm(experts(W_down x))
    + shared(x), the router still reading the full-width x (LatentMoE)."""

    def __init__(
        self,
        D: int,
        E: int,
        k: int,
        I: int,
        shared_inter: int,
        latent: int | None = None,
        act: str = "swiglu",
        eps: float = 1e-6,
        **router,
    ):
        super().__init__()
        self.gate = Router(D, E, k, **router)
        width = latent or D
        self.experts = Experts(E, width, I, act)
        self.shared_experts = MLP(D, shared_inter, act) if shared_inter else None
        if latent:
            self.latent_down = nn.Linear(D, latent, bias=False)
            self.latent_norm = RMSNorm(latent, eps)
            self.latent_up = nn.Linear(latent, D, bias=False)
        self.latent = latent

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        flat = x_BTD.reshape(-1, x_BTD.shape[-1])
        idx, w = self.gate(flat)
        z = self.latent_down(flat) if self.latent else flat
        y = self.experts(z, idx, w)
        if self.latent:
            y = self.latent_up(self.latent_norm(y))
        y = y.view_as(x_BTD)
        return y + self.shared_experts(x_BTD) if self.shared_experts is not None else y
