"""Linear + cross-entropy without the full logits: the reference.

    loss = mean over targets of  logsumexp(h_n W^T) - h_n . W[y_n]
    right = how many targets are the argmax of their logits (first index on ties), no gradient

The forward walks token chunks and, inside each, vocabulary chunks, keeping a running
logsumexp: memory O(token_chunk * vocab_chunk + N) instead of O(N * V) (at 32k tokens and a 160k
vocabulary the full fp32 logits are 21 GB). The backward recomputes each chunk's logits from the
saved h, W and logsumexp: dlogits = softmax - onehot, so dh = dlogits W and dW = dlogits^T h. Exact:
no gradient filtering, results equal the full computation to rounding.

Legend: N tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, W_VD, labels_N, ignore_index, token_chunk, vocab_chunk):
        N, V = h_ND.shape[0], W_VD.shape[0]
        acc = torch.promote_types(h_ND.dtype, torch.float32)
        lse = torch.empty(N, dtype=acc, device=h_ND.device)
        target = torch.zeros(N, dtype=acc, device=h_ND.device)
        arg = torch.zeros(N, dtype=torch.long, device=h_ND.device)
        valid = labels_N != ignore_index
        for t in range(0, N, token_chunk):
            h = h_ND[t : t + token_chunk].to(acc)
            y = labels_N[t : t + token_chunk]
            run = torch.full((h.shape[0],), float("-inf"), dtype=acc, device=h.device)
            best = torch.full_like(run, float("-inf"))
            for v in range(0, V, vocab_chunk):
                logits = h @ W_VD[v : v + vocab_chunk].to(acc).t()
                run = torch.logaddexp(run, torch.logsumexp(logits, -1))
                top, at = logits.max(-1)
                better = top > best  # strictly: an earlier chunk keeps a tie
                best, arg[t : t + token_chunk] = (
                    torch.where(better, top, best),
                    torch.where(better, at + v, arg[t : t + token_chunk]),
                )
                hit = (y >= v) & (y < v + logits.shape[1])
                rows = hit.nonzero(as_tuple=True)[0]
                target[t + rows] = logits[rows, y[rows] - v]
            lse[t : t + token_chunk] = run
        n = int(valid.sum())
        ctx.save_for_backward(h_ND, W_VD, labels_N, lse, valid)
        ctx.sizes = (token_chunk, vocab_chunk, max(n, 1))
        right = ((arg == labels_N) & valid).sum()
        ctx.mark_non_differentiable(right)
        return ((lse - target) * valid).sum() / max(n, 1), right

    @staticmethod
    def backward(ctx, grad, _right):
        h_ND, W_VD, labels_N, lse, valid = ctx.saved_tensors
        token_chunk, vocab_chunk, n = ctx.sizes
        acc = lse.dtype
        dh = torch.zeros(h_ND.shape, dtype=acc, device=h_ND.device) if ctx.needs_input_grad[0] else None
        dW = torch.zeros(W_VD.shape, dtype=acc, device=W_VD.device) if ctx.needs_input_grad[1] else None
        scale = grad.to(acc) / n
        for t in range(0, h_ND.shape[0], token_chunk):
            h = h_ND[t : t + token_chunk].to(acc)
            y = labels_N[t : t + token_chunk]
            w_row = valid[t : t + token_chunk].to(acc) * scale  # each token's share of the loss
            for v in range(0, W_VD.shape[0], vocab_chunk):
                Wc = W_VD[v : v + vocab_chunk].to(acc)
                d = torch.exp(h @ Wc.t() - lse[t : t + token_chunk, None])  # softmax
                hit = ((y >= v) & (y < v + Wc.shape[0])).nonzero(as_tuple=True)[0]
                d[hit, y[hit] - v] -= 1.0
                d *= w_row[:, None]
                if dh is not None:
                    dh[t : t + token_chunk] += d @ Wc
                if dW is not None:
                    dW[v : v + vocab_chunk] += d.t() @ h
        return (
            dh.to(h_ND.dtype) if dh is not None else None,
            dW.to(W_VD.dtype) if dW is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    h_ND: torch.Tensor,
    W_VD: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = -100,
    token_chunk: int = 4096,
    vocab_chunk: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the logits h @ W^T over the tokens whose label is not ignore_index,
    and how many of those tokens the argmax gets right (a long, no gradient)."""
    return _LinearCrossEntropy.apply(h_ND, W_VD, labels_N, ignore_index, token_chunk, vocab_chunk)
