"""The short convolution of KDA's q, k and v: the reference (the definition).

    y[b, t, c] = silu( sum_j w[c, j] x[b, t - (W - 1) + j, c] )

depthwise (one filter of width W per channel), causal, zero before the row's start; with
``cu_seqlens`` (document offsets along T, the same in every row) zero before each document's start
too, so that no document sees the one before it. Matmul-like under autocast: x and w in the
autocast dtype, as ``F.conv1d`` takes them. With ``head_norm`` = n > 0 (KDA's q and k: n = the head
dim) each group of n channels is then L2-normalised in fp32, fla's form:
y / sqrt(sum y^2 + 1e-6), and returned in y's dtype.

Legend: B rows, T tokens, C channels, W the filter's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln_kernels.widths import cast, wide

EPS = 1e-6  # the L2 norm's


def short_conv(
    x_BTC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor | None = None, head_norm: int = 0
) -> torch.Tensor:
    W = weight_C1W.shape[-1]
    if cu_seqlens is None:
        y = F.conv1d(x_BTC.transpose(1, 2), weight_C1W, padding=W - 1, groups=x_BTC.shape[-1])
        y = F.silu(y[..., : x_BTC.shape[1]].transpose(1, 2))
    else:
        cu = cu_seqlens.tolist()
        y = torch.cat([short_conv(x_BTC[:, a:b], weight_C1W) for a, b in zip(cu, cu[1:], strict=False)], 1)
    return head_l2_norm(y, head_norm) if head_norm else y


def head_l2_norm(y: torch.Tensor, n: int) -> torch.Tensor:
    """Each group of ``n`` channels L2-normalised in fp32 (fla's form), returned in y's dtype."""
    v = wide(y.unflatten(-1, (-1, n)))
    return cast((v * torch.rsqrt((v * v).sum(-1, keepdim=True) + EPS)).flatten(-2), y.dtype)
