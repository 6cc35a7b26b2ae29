"""RMSNorm and the gated RMSNorm of KDA's output: the reference (the definition).

    rms_norm(x, w)          = w * round_x(x r),            r = 1 / sqrt(mean(x^2) + eps)
    gated_rms_norm(x, g, w) = round_x(w x r sigmoid(g))

over the last dim, in fp32 (fp64 stays fp64); round_x casts back to x's dtype. rms_norm's result
is in the wider of w's and x's dtypes (fp32 for a bf16 x and an fp32 weight, as transformers'
Llama-style norms give), the gated one in x's. Both are elementwise: autocast leaves them as they
are.

Legend: N rows (all dims but the last), D the last dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln_kernels.widths import WIDE, cast, wide


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x r in fp32 (or wider): torch's one op for it (a decode step's norms are a few rows,
    their time the host's per op)."""
    return F.rms_norm(wide(x), x.shape[-1:], eps=eps)


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    if x.dtype == weight_D.dtype and x.dtype in WIDE:  # nothing to round: torch's norm weighs as
        y = F.rms_norm(x, x.shape[-1:], weight_D, eps=eps)  # the definition does, in one op
    else:
        y = weight_D * cast(_normed(x, eps), x.dtype)
    return y if dtype is None else y.to(dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    return cast(wide(weight_D) * _normed(x, eps) * torch.sigmoid(wide(gate)), x.dtype)
