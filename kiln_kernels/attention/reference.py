"""Causal attention over packed documents: the reference (the definition), and the per-document
form the CPU runs.

Queries and keys are packed back to back along one axis, cut into documents by ``cu_q`` and
``cu_k`` (offsets, [N + 1], host memory). Document n's queries q[cu_q[n]:cu_q[n+1]] attend to
its keys k[cu_k[n]:cu_k[n+1]], causally, the queries aligned with the *last* keys: with Lq
queries and Lk >= Lq keys, query i sees keys j <= i + Lk - Lq. With ``cu_k`` = ``cu_q`` that is
plain causal attention inside each document; with fewer queries than keys it is the attention of
a document's later part (this rank's tokens, under context parallel) to the whole of it so far.
An empty document is allowed (two equal offsets): it has no queries.

    o_i = sum_j softmax_j(scale * q_i . k_j) v_j     over the keys query i sees

Legend: T queries, S keys, H heads, D query/key dim, E value dim, N documents.
Shapes: q [T, H, D], k [S, H, D], v [S, H, E]; returns o [T, H, E] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, T: int, S: int) -> tuple[list[int], list[int]]:
    """The offsets as lists, after checking them: both rise from 0 to T (S), one more entry than
    documents each, and no document has more queries than keys."""
    a, b = cu_q.tolist(), cu_k.tolist()
    if len(a) != len(b) or a[0] != 0 or b[0] != 0 or a[-1] != T or b[-1] != S:
        raise ValueError(f"cu_q must rise from 0 to {T} and cu_k from 0 to {S}, as many each; got {a} and {b}")
    for n, (q0, q1, k0, k1) in enumerate(zip(a, a[1:], b, b[1:], strict=False)):
        if q1 < q0 or k1 < k0 or q1 - q0 > k1 - k0:
            raise ValueError(f"document {n}: {q1 - q0} queries and {k1 - k0} keys (needs 0 <= queries <= keys)")
    return a, b


def document_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Which keys each query sees, [T, S] bool: its own document's, up to its own place."""
    a, b = cu_q.tolist(), cu_k.tolist()
    T, S = a[-1], b[-1]
    doc_q = torch.repeat_interleave(torch.arange(len(a) - 1), torch.tensor(a).diff())
    doc_k = torch.repeat_interleave(torch.arange(len(b) - 1), torch.tensor(b).diff())
    # a query's place counted from its document's end, against each key's: j - k_end <= i - q_end
    to_end_q = torch.arange(T) - torch.tensor(a[1:])[doc_q]
    to_end_k = torch.arange(S) - torch.tensor(b[1:])[doc_k]
    mask = (doc_q[:, None] == doc_k[None, :]) & (to_end_k[None, :] <= to_end_q[:, None])
    return mask.to(device)


def varlen_attention(
    q_THD: torch.Tensor,
    k_SHD: torch.Tensor,
    v_SHE: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The definition: one [T, S] mask over the whole packed axis, the softmax in fp32 (fp64 for
    fp64 inputs). O(T * S) memory: for checking, not for training."""
    cu_k = cu_q if cu_k is None else cu_k
    T, S = q_THD.shape[0], k_SHD.shape[0]
    check_offsets(cu_q, cu_k, T, S)
    up = torch.promote_types(q_THD.dtype, torch.float32)
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("thd,shd->hts", q_THD.to(up), k_SHD.to(up)) * scale
    mask = document_mask(cu_q, cu_k, q_THD.device)
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)  # a query with no key: 0
    return torch.einsum("hts,she->the", p, v_SHE.to(up)).to(q_THD.dtype)


def per_document(
    q_THD: torch.Tensor,
    k_SHD: torch.Tensor,
    v_SHE: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same function, one document at a time through SDPA (its flash kernel on the CPU for
    plain causal documents): no [T, S] mask, memory of the largest document only. The CPU's form,
    and CUDA's for fp32 (torch's flash kernels take 16-bit inputs only)."""
    cu_k = cu_q if cu_k is None else cu_k
    a, b = check_offsets(cu_q, cu_k, q_THD.shape[0], k_SHD.shape[0])
    outs = []
    for q0, q1, k0, k1 in zip(a, a[1:], b, b[1:], strict=False):
        if q1 == q0:
            continue
        q, k, v = (x.transpose(0, 1) for x in (q_THD[q0:q1], k_SHD[k0:k1], v_SHE[k0:k1]))  # [H, L, .]
        if q1 - q0 == k1 - k0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:  # the queries are the keys' last ones
            seen = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril(k1 - k0 - (q1 - q0))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale)
        outs.append(o.transpose(0, 1))
    if not outs:
        return q_THD.new_zeros(0, *v_SHE.shape[1:])
    return torch.cat(outs)  # in SDPA's dtype (autocast's, under autocast)
