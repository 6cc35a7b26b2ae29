"""KDA's short causal convolution with SiLU (and q's and k's L2 norm per head): ``reference.py``
(the definition, CPU) and ``triton.py`` (CUDA: on the [B, T, C] layout as it comes, no transposes,
the SiLU and the norm fused, documents found on the device), one signature; ``short_conv`` picks
by device."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln_kernels.conv import reference
from kiln_kernels.dispatch import fast


def short_conv(
    x_BTC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor | None = None, head_norm: int = 0
) -> torch.Tensor:
    impl: ModuleType  # the Triton module or the reference
    if fast(x_BTC, weight_C1W):
        from kiln_kernels.conv import triton as impl  # imports triton: CUDA machines only
    else:
        impl = reference
    return impl.short_conv(x_BTC, weight_C1W, cu_seqlens, head_norm)


__all__ = ["short_conv"]
