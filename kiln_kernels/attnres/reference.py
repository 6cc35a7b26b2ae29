"""Attention Residuals (arXiv 2603.15031): a layer's input is attention over depth.

    h = sum_i alpha_i v_i,   alpha = softmax_i(w . RMSNorm(v_i))

one learned pseudo-query w per site (input-independent), keys the RMS-normalised sources, values
the raw sources, the softmax over the sources for each token, in fp32. The reference.

Legend: L sources, B batch, T tokens, D hidden.
"""

from __future__ import annotations

import torch


def depth_attention(sources_LBTD: torch.Tensor, w_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[B, T, D] in the sources' dtype; the softmax and the sum are in fp32 (or fp64)."""
    up = torch.promote_types(sources_LBTD.dtype, torch.float32)
    v = sources_LBTD.to(up)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(torch.einsum("lbtd,d->lbt", keys, w_D.to(up)), dim=0)
    return torch.einsum("lbt,lbtd->btd", alpha, v).to(sources_LBTD.dtype)
