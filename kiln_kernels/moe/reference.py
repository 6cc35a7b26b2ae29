"""The experts of an MoE layer on rows already grouped by expert: the reference (a loop).

    y_m = W2_e act(W1g_e x_m, W1u_e x_m)   for the rows m of expert e (rows of expert 0 first,
                                           then expert 1's, ..., ``counts_E`` of each)
with LoRA on either projection computed from its factors: W x + scaling * B_e (A_e x), never
W + B A. ``gate_up_E2ID`` is [E, 2I, D] (gate rows, then up rows), ``down_EDI`` [E, D, I],
``lora`` maps "gate_up_proj" / "down_proj" to (A [E, r, in], B [E, out, r]).

Legend: M rows, D width, I expert width, E experts, r LoRA rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Lora = dict[str, tuple[torch.Tensor, torch.Tensor]]


def grouped_mlp(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
) -> torch.Tensor:
    """[M, D] -> [M, D]: every expert on its own rows."""
    lora = lora or {}

    def proj(name: str, W: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W[e])
        if name not in lora:
            return y
        A, B = lora[name]
        return y + ((x.to(A.dtype) @ A[e].t()) @ B[e].t() * scaling).to(x.dtype)

    out = []
    for e, rows in enumerate(x_MD.split(counts_E.tolist())):
        gate, up = proj("gate_up_proj", gate_up_E2ID, e, rows).chunk(2, -1)
        out.append(proj("down_proj", down_EDI, e, act(gate, up)))
    return torch.cat(out) if out else x_MD.new_zeros(0, down_EDI.shape[1])


def permute(x_ND: torch.Tensor, tok_M: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """The (token, slot) pairs' rows in expert order, [M, D]: row m is token tok[m]; ``inv_NK``
    (each pair's row) is the fast version's and unused here."""
    return x_ND[tok_M]


def unpermute(y_MD: torch.Tensor, inv_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """Each token's k rows weighted and summed, [N, D] in the wider of the two dtypes:
    sum_k w[t, k] y[inv[t, k]]."""
    dt = torch.promote_types(y_MD.dtype, w_NK.dtype)
    return (y_MD[inv_NK.long()].to(dt) * w_NK[..., None].to(dt)).sum(1)
