"""The experts of an MoE layer on rows already grouped by expert: the reference (a loop).

    y_m = W2_e (w_m act(W1g_e x_m, W1u_e x_m))   for the rows m of expert e (rows of expert 0
                                                 first, then expert 1's, ..., ``counts_E`` of each)
with LoRA on either projection computed from its factors: W x + scaling * B_e (A_e x), never
W + B A. ``gate_up_E2ID`` is [E, 2I, D] (gate rows, then up rows), ``down_EDI`` [E, D, I],
``lora`` maps "gate_up_proj" / "down_proj" to (A [E, r, in], B [E, out, r]); ``w_M`` (the rows'
routing weights; None: 1) weighs the activation, so the rows come out weighed and a token's
output is the plain sum of its rows (``unpermute``).

``swiglu`` is the experts' activation, ``swiglu_rows`` the same on the gate/up product's rows as
the fused kernel takes them ([M, 2I]: the gate half, then the up half), weighed.

Legend: M rows, D width, I expert width, E experts, r LoRA rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln_kernels.widths import cast, wide, wide_dtype

Lora = dict[str, tuple[torch.Tensor, torch.Tensor]]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_rows(gu_M2I: torch.Tensor, w_M: torch.Tensor | None = None) -> torch.Tensor:
    """[M, 2I] -> [M, I]: w_m silu(gate) * up of each row's halves."""
    return weigh(swiglu(*gu_M2I.chunk(2, -1)), w_M)


def weigh(h_MI: torch.Tensor, w_M: torch.Tensor | None) -> torch.Tensor:
    """Each row times its routing weight (None: as it is), in h's dtype."""
    return h_MI if w_M is None else (h_MI * w_M[:, None]).to(h_MI.dtype)


def grouped_mlp(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, D] -> [M, D]: every expert on its own rows, weighed (``per_expert``). Few rows without
    autograd (a decode step: their gathered weights at most 2^22 numbers): ``per_row``, the same
    products row by row (its backward sums the gathered weights' gradients in no fixed order, so
    training keeps the loop: Swap Core's recompute is bit-equal to the step without it)."""
    few = not torch.is_grad_enabled() and x_MD.shape[0] * gate_up_E2ID[0].numel() <= 1 << 22
    return (per_row if few else per_expert)(x_MD, counts_E, gate_up_E2ID, down_EDI, act, lora, scaling, w_M)


def per_expert(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loop over the experts, each on its rows."""
    lora = lora or {}

    def proj(name: str, W: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W[e])
        if name not in lora:
            return y
        A, B = lora[name]
        return y + ((x.to(A.dtype) @ A[e].t()) @ B[e].t() * scaling).to(x.dtype)

    out = []
    sizes = counts_E.tolist()
    weights = w_M.split(sizes) if w_M is not None else [None] * len(sizes)
    for e, (rows, w) in enumerate(zip(x_MD.split(sizes), weights, strict=True)):
        gate, up = proj("gate_up_proj", gate_up_E2ID, e, rows).chunk(2, -1)
        out.append(proj("down_proj", down_EDI, e, weigh(act(gate, up), w)))
    return torch.cat(out) if out else x_MD.new_zeros(0, down_EDI.shape[1])


def per_row(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grouped_mlp``'s products row by row, each row with its expert's weights gathered
    ([M, out, in]): a dozen ops whatever the number of experts, where the loop runs a dozen an
    expert (a decode step's few rows meet most experts once)."""
    lora = lora or {}
    e_M = torch.repeat_interleave(counts_E.to(x_MD.device))  # each row's expert

    def proj(name: str, W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # index_select, not W[e_M] (half the host time on a decode step's few rows); the adapter's
        # product summed into the base's by baddbmm, in the factors' dtype
        x3 = x[:, :, None]
        y = torch.bmm(W.index_select(0, e_M), x3)
        if name in lora:
            A, B = (f.index_select(0, e_M) for f in lora[name])
            y = torch.baddbmm(y.to(B.dtype), B, torch.bmm(A, x3.to(A.dtype)), alpha=scaling).to(y.dtype)
        return y[..., 0]

    gate, up = proj("gate_up_proj", gate_up_E2ID, x_MD).chunk(2, -1)
    return proj("down_proj", down_EDI, weigh(act(gate, up), w_M))


def every_expert_suits(idx_NK: torch.Tensor, gate_up_E2ID: torch.Tensor) -> bool:
    """``every_expert`` for N tokens of k experts each: no autograd (a decode step), no more experts
    than the (token, expert) pairs (a gather of each pair's weights would copy every expert's
    anyway) and at most 2^22 products' numbers."""
    (N, k), E = idx_NK.shape, gate_up_E2ID.shape[0]
    return not torch.is_grad_enabled() and E <= N * k and N * gate_up_E2ID.numel() <= 1 << 22


def every_expert(
    x_ND: torch.Tensor,
    idx_NK: torch.Tensor,
    w_NK: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
) -> torch.Tensor:
    """[N, D]: each token's experts as the MoE layer sums them (the sort, ``grouped_mlp`` and the
    sum back into the tokens), computed as every expert on every token weighed by its routing
    weight there, 0 where the token did not choose it: a dozen ops and no sort, where a decode
    step's few tokens meet most experts anyway (``every_expert_suits``). Sums in fp32 (or
    wider)."""
    lora = lora or {}
    E, N = gate_up_E2ID.shape[0], x_ND.shape[0]
    w_EN1 = w_NK.new_zeros(N, E).scatter_(1, idx_NK, w_NK).t()[..., None]

    def proj(name: str, W: torch.Tensor, x_ENI: torch.Tensor) -> torch.Tensor:
        y = torch.bmm(x_ENI, W.transpose(1, 2))
        if name in lora:
            A, B = lora[name]
            low = torch.bmm(cast(x_ENI, A.dtype), A.transpose(1, 2))
            y = cast(torch.baddbmm(cast(y, B.dtype), low, B.transpose(1, 2), alpha=scaling), y.dtype)
        return y

    gate, up = proj("gate_up_proj", gate_up_E2ID, x_ND[None].expand(E, N, -1)).chunk(2, -1)
    h = cast(act(gate, up) * w_EN1, gate.dtype)
    return cast(proj("down_proj", down_EDI, h), wide_dtype(x_ND.dtype)).sum(0)


def permute(x_ND: torch.Tensor, tok_M: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """The (token, slot) pairs' rows in expert order, [M, D]: row m is token tok[m]; ``inv_NK``
    (each pair's row) is the fast version's and unused here."""
    return x_ND[tok_M]


def unpermute(y_MD: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """Each token's k rows (weighed already) summed, [N, D] in fp32 (or wider): sum_k y[inv[t, k]]."""
    return wide(y_MD[inv_NK.long()]).sum(1)
