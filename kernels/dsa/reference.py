"""DeepSeek Sparse Attention: the lightning indexer, top-k selection, attention over the
selected keys, and the indexer's training loss. The reference (dense masks, readable).

    I[t, s] = sum_j w[t, j] * ReLU(scale * q[t, j] . k[s])      (s allowed by the mask)
    S_t     = top-k_s I[t, s]                                     (k = 2048 in DeepSeek V3.2 / K3)
    o_t     = softmax over s in S_t of (scale_attn * Q_t . K_s) V_s
    L_I     = sum_t KL(p_t || softmax(I_t restricted to S_t)),  p_t = main attention summed
              over heads, L1-normalised, on S_t; the indexer's input is detached for it.

With k >= the number of allowed keys, the attention is exactly dense causal attention.
``allowed_BTT`` is the causal mask, and-ed with the document mask for packed rows.

Legend: B batch, T queries, S keys (= T), H heads, J index heads, D dims, K top-k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def indexer_scores(q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor,
                   allowed_BTS: torch.Tensor) -> torch.Tensor:
    """Index scores [B, T, S] (fp32 or fp64), -inf where a key is not allowed."""
    up = torch.promote_types(q_BTJD.dtype, torch.float32)
    scale = q_BTJD.shape[-1] ** -0.5
    dots = torch.einsum("btjd,bsd->btjs", q_BTJD.to(up), k_BSD.to(up)) * scale
    scores = torch.einsum("btj,btjs->bts", w_BTJ.to(up), F.relu(dots))
    return scores.masked_fill(~allowed_BTS, float("-inf"))


def select_topk(scores_BTS: torch.Tensor, k: int, allowed_BTS: torch.Tensor) -> torch.Tensor:
    """The selected keys as a mask [B, T, S]: the k best allowed keys of each query (all of
    them when fewer than k are allowed). Ties (ReLU makes exact zeros common) go to the earlier
    key, so the choice does not depend on where a document sits in a packed row."""
    k = min(k, scores_BTS.shape[-1])
    idx = torch.sort(scores_BTS, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(allowed_BTS).scatter_(-1, idx, True)
    return chosen & allowed_BTS


def sparse_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSE: torch.Tensor, selected_BTS: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of each query over its selected keys only. [B, H, T, E]."""
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSE, attn_mask=selected_BTS[:, None], scale=scale)


def indexer_kl_loss(attn_BHTS: torch.Tensor, scores_BTS: torch.Tensor, selected_BTS: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(I)) on the selected keys, summed over queries, averaged over the batch.
    ``attn_BHTS`` (the main attention's probabilities) is a target: no gradient flows into it."""
    p = attn_BHTS.detach().sum(1).masked_fill(~selected_BTS, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    log_q = torch.log_softmax(scores_BTS.masked_fill(~selected_BTS, float("-inf")), -1)
    kl = torch.where(selected_BTS & (p > 0), p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p))
    return kl.sum((-1, -2)).mean()
