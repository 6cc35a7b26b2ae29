"""The short convolution of KDA's q, k and v: the reference (the definition).

    y[b, t, c] = silu( sum_j w[c, j] x[b, t - (W - 1) + j, c] )

depthwise (one filter of width W per channel), causal, zero before the row's start; with
``cu_seqlens`` (document offsets along T, the same in every row) zero before each document's start
too, so that no document sees the one before it. Matmul-like under autocast: x and w in the
autocast dtype, as ``F.conv1d`` takes them.

Legend: B rows, T tokens, C channels, W the filter's width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(x_BTC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    W = weight_C1W.shape[-1]
    if cu_seqlens is None:
        y = F.conv1d(x_BTC.transpose(1, 2), weight_C1W, padding=W - 1, groups=x_BTC.shape[-1])
        return F.silu(y[..., : x_BTC.shape[1]].transpose(1, 2))
    cu = cu_seqlens.tolist()
    return torch.cat([short_conv(x_BTC[:, a:b], weight_C1W) for a, b in zip(cu, cu[1:])], 1)
