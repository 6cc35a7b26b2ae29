"""DeepSeek Sparse Attention: ``reference.py`` (the definition, CPU) and ``triton.py`` (CUDA and Ascend), one
signature; each function picks by device (``kiln_kernels.dispatch``)."""

from __future__ import annotations

import torch

from kiln_kernels.dispatch import impl, kept
from kiln_kernels.dsa.reference import allowed_keys, indexer_scores


def _impl(*tensors: torch.Tensor):
    return impl("dsa", *tensors)  # the Triton module (imports triton: accelerator machines only) or the reference


@torch.library.custom_op("kiln::indexer_topk", mutates_args=())
def _topk_op(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, starts_BT: torch.Tensor, topk: int
) -> torch.Tensor:
    """``reference.indexer_topk`` or its kernel, as one op (``kiln::indexer_topk``).

    Scored outside autocast, always (fp32, as the kernel does): a dispatch mode runs a custom op's
    body with autocast off, and the reference's fp32 matmuls would otherwise round to bf16 without
    a mode and not with one, choosing other keys."""
    with torch.autocast(q_BTJD.device.type, enabled=False):
        return _impl(q_BTJD, k_BSD, w_BTJ).indexer_topk(q_BTJD, k_BSD, w_BTJ, starts_BT, topk)


@_topk_op.register_fake
def _(q_BTJD, k_BSD, w_BTJ, starts_BT, topk):
    return q_BTJD.new_empty(*q_BTJD.shape[:2], min(topk, k_BSD.shape[1]), dtype=torch.int32)


def indexer_topk(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, starts_BT: torch.Tensor, topk: int
) -> torch.Tensor:
    """The keys each query attends to. A selection: Swap Core keeps it whenever it keeps anything
    (``kept``), so that a recompute attends to the keys the forward chose."""
    return kept("indexer_topk", lambda: _topk_op(q_BTJD, k_BSD, w_BTJ, starts_BT, topk))


def sparse_attention(q_BTHD, k_BSGD, v_BSGE, idx_BTK, scale: float, indexer=None):
    """With ``indexer`` (its q, k, w): (o, the indexer's KL loss); the kernels' loss has its value
    only after the backward, which computes the target (``triton._SparseAttention``)."""
    return _impl(q_BTHD, k_BSGD, v_BSGE).sparse_attention(q_BTHD, k_BSGD, v_BSGE, idx_BTK, scale, indexer)


def indexer_kl_loss(q_BTJD, k_BSD, w_BTJ, idx_BTK, p_BTK) -> torch.Tensor:
    return _impl(q_BTJD, k_BSD, w_BTJ).indexer_kl_loss(q_BTJD, k_BSD, w_BTJ, idx_BTK, p_BTK)


__all__ = ["allowed_keys", "indexer_kl_loss", "indexer_scores", "indexer_topk", "sparse_attention"]
