"""DeepSeek Sparse Attention: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA), one
signature; each function picks by device (``kernels.dispatch``)."""
from __future__ import annotations

import torch

from kernels.dispatch import fast
from kernels.dsa import reference
from kernels.dsa.reference import allowed_keys, indexer_scores


def _impl(*tensors: torch.Tensor):
    if fast(*tensors):
        from kernels.dsa import triton as impl  # imports triton: CUDA machines only
        return impl
    return reference


def indexer_topk(q_BTJD, k_BSD, w_BTJ, starts_BT, topk: int) -> torch.Tensor:
    return _impl(q_BTJD, k_BSD, w_BTJ).indexer_topk(q_BTJD, k_BSD, w_BTJ, starts_BT, topk)


def sparse_attention(q_BTHD, k_BSGD, v_BSGE, idx_BTK, scale: float, with_weights: bool = False):
    return _impl(q_BTHD, k_BSGD, v_BSGE).sparse_attention(q_BTHD, k_BSGD, v_BSGE, idx_BTK, scale, with_weights)


def indexer_kl_loss(q_BTJD, k_BSD, w_BTJ, idx_BTK, p_BTK) -> torch.Tensor:
    return _impl(q_BTJD, k_BSD, w_BTJ).indexer_kl_loss(q_BTJD, k_BSD, w_BTJ, idx_BTK, p_BTK)


__all__ = ["allowed_keys", "indexer_kl_loss", "indexer_scores", "indexer_topk", "sparse_attention"]
