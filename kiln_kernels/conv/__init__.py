"""KDA's short causal convolution with SiLU (and q's and k's L2 norm per head): ``reference.py``
(the definition, CPU) and ``triton.py`` (CUDA and Ascend: on the [B, T, C] layout as it comes, no transposes,
the SiLU and the norm fused, documents found on the device), one signature; ``short_conv`` picks
by device."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl


def short_conv(
    x_BTC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor | None = None, head_norm: int = 0
) -> torch.Tensor:
    return impl("short_conv", x_BTC, weight_C1W).short_conv(x_BTC, weight_C1W, cu_seqlens, head_norm)


__all__ = ["short_conv"]
