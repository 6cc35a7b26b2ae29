"""Linear + cross-entropy on CUDA: the reference's result and gradients, never the N x V logits.

Per chunk of C tokens (Legend: N tokens, D hidden, V vocabulary, C chunk):
1. logits_CV = h_CD W^T (cuBLAS, the inputs' dtype);
2. one Triton program per row reads its logits twice: an online max / sum gives the logsumexp,
   the row's loss and whether its argmax is the target (the accuracy metric, without a third
   product with W), then the row is overwritten in place with its gradient,
   (softmax - onehot) / n_targets (0 for ignored rows);
3. dh_CD = dlogits_CV W (cuBLAS), dW += dlogits^T h_CD (cuBLAS addmm in place, W's dtype).
The gradients are made in the forward (as Liger does) and scaled by the upstream gradient in the
backward, so the loss costs one pass: 3 GEMMs of 2 N V D FLOPs. Memory: C x V logits and the
gradients, not N x V (at 32k tokens and a 160k vocabulary the fp32 logits alone are 21 GB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A chunk's logits at most 0.5 GiB. The loss's forward comes when every activation of the step is
# alive, so its chunk sits on the step's peak: 2 GiB chunks ran the loss at 1.02-1.035x Liger's
# speed on the H200 and 0.5 GiB ones at 1.00x (bench/loss.py's sweep, 32k tokens, bench/RESULTS.md),
# but the former hold the 8k step's peak 0.75 GiB higher.
CHUNK_BYTES = 512 << 20
BLOCK, WARPS = 8192, 8  # columns a loop step and warps a row: within noise of the best (same sweep)
# (a smaller vocabulary takes the power of two that holds it: the byte tokenizer's 263 take 512 lanes)


@triton.jit
def _ce_rows(logits_ptr, stride, labels_ptr, loss_ptr, hit_ptr, V, ignore_index, inv_n_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    y = tl.load(labels_ptr + row)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    arg = tl.zeros((), tl.int64)
    for v in range(0, V, BLOCK):
        cols = v + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        top = tl.max(x, 0)
        arg = tl.where(top > m, v + tl.argmax(x, 0).to(tl.int64), arg)  # strictly: the first index on ties
        m_new = tl.maximum(m, top)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    valid = y != ignore_index
    x_y = tl.load(base + tl.where(valid, y, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_y, 0.0))
    tl.store(hit_ptr + row, (valid & (arg == y)).to(tl.int32))
    scale = tl.where(valid, tl.load(inv_n_ptr), 0.0)
    for v in range(0, V, BLOCK):
        cols = v + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == y, 1.0, 0.0)
        tl.store(base + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=cols < V)


ROWS = 256  # a chunk's rows come in multiples of this where there are several (see _chunk)


def _chunk(N: int, V: int, itemsize: int) -> int:
    """Rows a chunk: as many as CHUNK_BYTES of logits hold, evened out, in multiples of ROWS where
    the rows take several chunks (16 where fewer than ROWS rows fit).

    - Whole tiles: cuBLAS runs the chunk's two vocabulary GEMMs in 192- and 256-row tiles, and the
      evened 1,366-row chunks of an 8k step left a tenth of the last tiles empty. 1,536-row
      chunks (five, and a 512-row tail) made the whole 8k step 2-3.5% faster (one document) and
      2% (4k documents) on an H100, alternating runs (bench/RESULTS.md, 2026-12-06).
    - Aligned slices: every chunk's slices of the per-row tensors start 16-byte aligned, as the
      first's, so one compile of ``_ce_rows`` serves them all (the odd 1,619-row chunks of a 128k
      row were a specialisation of their own, which a first step's rehearsal on a slice of the row
      did not compile: 1.5 s of that first step)."""
    most = max(16, CHUNK_BYTES // (V * itemsize))
    step = ROWS if most >= ROWS else 16
    most = most // step * step
    even = -(-N // -(-N // most))
    return min(N, -(-even // step) * step)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, W_VD, labels_N, ignore_index, token_chunk, vocab_chunk):
        N, D = h_ND.shape
        V = W_VD.shape[0]
        h_ND, W_VD, labels_N = h_ND.contiguous(), W_VD.contiguous(), labels_N.contiguous()
        # the target count stays on the device: read back here, it would stall the host until the
        # whole forward had run, before the loss's and the backward's launches
        n = (labels_N != ignore_index).sum().clamp_(min=1)
        inv_n = 1.0 / n.to(torch.float32)  # exact as the host's: n < 2^24
        loss_N = torch.empty(N, dtype=torch.float32, device=h_ND.device)
        hit_N = torch.empty(N, dtype=torch.int32, device=h_ND.device)
        dh = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        dW = torch.empty_like(W_VD) if ctx.needs_input_grad[1] else None
        C = _chunk(N, V, h_ND.element_size())
        block = min(BLOCK, triton.next_power_of_2(V))
        buf = h_ND.new_empty(min(C, N), V)  # one chunk's logits, reused: a second chunk's would double the peak
        for t in range(0, N, C):
            h = h_ND[t : t + C]
            logits = torch.mm(h, W_VD.t(), out=buf[: h.shape[0]])
            _ce_rows[(h.shape[0],)](
                logits,
                logits.stride(0),
                labels_N[t : t + C],
                loss_N[t : t + C],
                hit_N[t : t + C],
                V,
                ignore_index,
                inv_n,
                BLOCK=block,
                num_warps=WARPS,
            )
            if dh is not None:
                torch.mm(logits, W_VD, out=dh[t : t + C])
            if dW is not None:  # accumulated in W's dtype, in place (as Liger does): no V x D temporary
                torch.addmm(dW, logits.t(), h, beta=1.0 if t else 0.0, out=dW)
        ctx.save_for_backward(dh, dW)
        ctx.done = False
        right = hit_N.sum(dtype=torch.long)
        ctx.mark_non_differentiable(right)
        return loss_N.sum() / n, right

    @staticmethod
    def backward(ctx, grad, _right):
        if ctx.done:
            raise RuntimeError("linear_cross_entropy's backward runs once: its gradients are made in the forward")
        ctx.done = True
        dh, dW = ctx.saved_tensors
        for g in (dh, dW):  # in place: no second copy of W's gradient
            if g is not None:
                g.mul_(grad.to(g.dtype))
        return dh, dW, None, None, None, None


def linear_cross_entropy(
    h_ND: torch.Tensor,
    W_VD: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = -100,
    token_chunk: int = 4096,
    vocab_chunk: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the logits h @ W^T over the tokens whose label is not ignore_index,
    and the count of those whose argmax is the label (``reference.linear_cross_entropy``).
    The chunk arguments are the reference's; here the token chunk follows from the vocabulary
    (CHUNK_BYTES) and each row's logits are taken whole."""
    return _LinearCrossEntropy.apply(h_ND, W_VD, labels_N, ignore_index, token_chunk, vocab_chunk)
