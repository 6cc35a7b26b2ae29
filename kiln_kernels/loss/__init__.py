"""Linear + cross-entropy without the full logits: ``reference.py`` (the definition, CPU) and
``triton.py`` (CUDA and Ascend), one signature; ``linear_cross_entropy`` picks by device."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl


def linear_cross_entropy(
    h_ND: torch.Tensor,
    W_VD: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = -100,
    token_chunk: int = 4096,
    vocab_chunk: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the targets, how many of them the argmax gets right)."""
    return impl("linear_cross_entropy", h_ND, W_VD).linear_cross_entropy(
        h_ND, W_VD, labels_N, ignore_index, token_chunk, vocab_chunk
    )


__all__ = ["linear_cross_entropy"]
