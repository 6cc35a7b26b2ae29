"""DeepSeek Sparse Attention: the lightning indexer with its top-k, attention over the selected
keys, and the indexer's training loss. The reference: dense scores and gathers, readable.

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] / sqrt(d))    (starts[t] <= s <= t + S - T)
    S_t     = top-k_s I[t, s]                                     (k = 2048 in DeepSeek V3.2 / K3)
    o_t,h   = softmax over s in S_t of (scale * Q_t,h . K_s) V_s
    L_I     = sum_t KL(p_t || softmax(I_t restricted to S_t)) / B,  p_t = the main attention's
              probabilities averaged over heads, on S_t (a target: no gradient flows into it)

With k >= the number of allowed keys, the attention is exactly dense causal attention.
``starts_BT`` is the first key each query may see: 0 for plain causal rows, the first token of the
query's document in packed rows (documents are contiguous).

Selections are index lists ``idx_BTK``: key positions, valid ones first, -1 for "none" (a query
allowed fewer than k keys). Keys come in groups: ``k_BSGD`` holds G key heads, each shared by
H / G query heads (G = 1 is MLA's absorbed, multi-query form; G = H plain multi-head).

Legend: B batch, T queries, S keys (= T; more under context parallel, the queries then the last T
of them, B = 1), H heads, G key heads, J index heads, D dims, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def allowed_keys(starts_BT: torch.Tensor, S: int) -> torch.Tensor:
    """[B, T, S] bool: starts[t] <= s <= t + S - T. The T queries are the last T of the S keys
    (S = T but under context parallel, where a rank's queries see the keys of earlier ranks)."""
    s = torch.arange(S, device=starts_BT.device)
    t = torch.arange(starts_BT.shape[1], device=starts_BT.device) + S - starts_BT.shape[1]
    return (s >= starts_BT[..., None]) & (s <= t[:, None])


def indexer_scores(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, starts_BT: torch.Tensor
) -> torch.Tensor:
    """Index scores [B, T, S] (fp32 or fp64), -inf where a key is not allowed."""
    up = torch.promote_types(q_BTJD.dtype, torch.float32)
    scale = q_BTJD.shape[-1] ** -0.5
    dots = torch.einsum("btjd,bsd->btjs", q_BTJD.to(up), k_BSD.to(up)) * scale
    scores = torch.einsum("btj,btjs->bts", w_BTJ.to(up), F.relu(dots))
    return scores.masked_fill(~allowed_keys(starts_BT, k_BSD.shape[1]), float("-inf"))


def indexer_topk(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, starts_BT: torch.Tensor, topk: int
) -> torch.Tensor:
    """The k best allowed keys of each query, [B, T, min(k, S)] int32, in descending position,
    -1 after the last. Ties (ReLU makes exact zeros common) go to the earlier key, so the choice
    does not depend on where a document sits in a packed row."""
    scores = indexer_scores(q_BTJD, k_BSD, w_BTJ, starts_BT)
    K = min(topk, scores.shape[-1])
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :K]
    ok = torch.gather(allowed_keys(starts_BT, scores.shape[-1]), -1, best)
    return torch.where(ok, best, -1).sort(-1, descending=True).values.int()


def _gathered(x_BSGD: torch.Tensor, idx_BTK: torch.Tensor) -> torch.Tensor:
    """x at the selected keys: [B, T, K, G, D] (a placeholder row where idx is -1)."""
    B, T, K = idx_BTK.shape
    flat = idx_BTK.clamp_min(0).long().reshape(B, T * K)
    rows = torch.gather(x_BSGD.flatten(2), 1, flat[..., None].expand(-1, -1, x_BSGD[0, 0].numel()))
    return rows.view(B, T, K, *x_BSGD.shape[2:])


def _head_scores(q_BTHD: torch.Tensor, k_BSGD: torch.Tensor, idx_BTK: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * q . k over the selected keys, [B, T, H, K], -inf where idx is -1."""
    B, T, H, _ = q_BTHD.shape
    G = k_BSGD.shape[2]
    q = q_BTHD.view(B, T, G, H // G, -1)
    s = torch.einsum("btgnd,btkgd->btgnk", q, _gathered(k_BSGD, idx_BTK)).reshape(B, T, H, -1) * scale
    return s.masked_fill((idx_BTK < 0)[:, :, None], float("-inf"))


def sparse_attention(
    q_BTHD: torch.Tensor,
    k_BSGD: torch.Tensor,
    v_BSGE: torch.Tensor,
    idx_BTK: torch.Tensor,
    scale: float,
    indexer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """Attention of each query over its selected keys only, [B, T, H, E]. ``indexer`` (its q, k
    and w, as ``indexer_scores`` takes them): also the indexer's KL loss (``indexer_kl_loss``)
    against its target, the probabilities on the selected keys averaged over heads (0 where idx
    is -1, summing to 1 per query), which carries no gradient: returns (o, loss)."""
    B, T, H, _ = q_BTHD.shape
    G = k_BSGD.shape[2]
    up = torch.promote_types(q_BTHD.dtype, torch.float32)
    p = torch.softmax(_head_scores(q_BTHD, k_BSGD, idx_BTK, scale).to(up), -1)
    o = torch.einsum("btgnk,btkge->btgne", p.to(q_BTHD.dtype).view(B, T, G, H // G, -1), _gathered(v_BSGE, idx_BTK))
    o = o.reshape(B, T, H, -1)
    if indexer is None:
        return o
    return o, indexer_kl_loss(*indexer, idx_BTK, p.detach().mean(2))


def indexer_kl_loss(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, idx_BTK: torch.Tensor, p_BTK: torch.Tensor
) -> torch.Tensor:
    """sum_t KL(p_t || softmax of the index scores over S_t), averaged over the batch. Gradients
    reach q, k and w; ``p_BTK`` is a target."""
    up = torch.promote_types(q_BTJD.dtype, torch.float32)
    k = _gathered(k_BSD[:, :, None], idx_BTK)[:, :, :, 0].to(up)  # [B, T, K, D]
    dots = torch.einsum("btjd,btkd->btjk", q_BTJD.to(up), k) * q_BTJD.shape[-1] ** -0.5
    scores = torch.einsum("btj,btjk->btk", w_BTJ.to(up), F.relu(dots))
    valid = idx_BTK >= 0
    log_q = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), -1)
    p = p_BTK.detach().to(up)
    kl = torch.where(valid & (p > 0), p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p))
    return kl.sum((-1, -2)).mean()
