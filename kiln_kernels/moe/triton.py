"""The experts' data movement in Triton: ``permute`` / ``unpermute``, the (token, slot) pairs in
expert order and back. The combine sums each token's k rows, weighted, in one program per token:
no atomics, so the result does not depend on scheduling (``index_add_`` does), and no [M, D]
temporary of weighted rows. ``inv_NK`` is each pair's row in expert order.

Same signatures as ``reference.py``. (The Triton grouped GEMM that once lived here is in
``kiln_kernels/experimental/grouped_gemm.py``: measured, not used by the engine.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine(Y, INV, WT, OUT, D, K: tl.constexpr, BD: tl.constexpr, WEIGHTED: tl.constexpr):
    """OUT[t] = sum_k w[t, k] Y[inv[t, k]] (w = 1 unless WEIGHTED)."""
    t, blk = tl.program_id(0), tl.program_id(1)
    d = blk * BD + tl.arange(0, BD)
    ok = d < D
    acc = tl.zeros([BD], tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(INV + t * K + k).to(tl.int64)
        y = tl.load(Y + pos * D + d, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = y * tl.load(WT + t * K + k).to(tl.float32)
        acc += y
    tl.store(OUT + t.to(tl.int64) * D + d, acc.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _combine_bwd(DOUT, Y, INV, WT, DY, DW, D, K: tl.constexpr, BD: tl.constexpr):
    """DY[inv[t, k]] = w[t, k] DOUT[t] (a permutation: each row written once) and
    DW[t, k] = DOUT[t] . Y[inv[t, k]]."""
    t = tl.program_id(0)
    for k in tl.static_range(K):
        pos = tl.load(INV + t * K + k).to(tl.int64)
        w = tl.load(WT + t * K + k).to(tl.float32)
        dot = tl.zeros([BD], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            ok = d < D
            g = tl.load(DOUT + t.to(tl.int64) * D + d, mask=ok, other=0.0).to(tl.float32)
            dot += g * tl.load(Y + pos * D + d, mask=ok, other=0.0).to(tl.float32)
            tl.store(DY + pos * D + d, (w * g).to(DY.dtype.element_ty), mask=ok)
        tl.store(DW + t * K + k, tl.sum(dot, 0))


def _row_block(D: int) -> int:
    """The slice of a row [D] one program step handles."""
    return min(1024, triton.next_power_of_2(D))


def _combine_rows(
    y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor | None, N: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    D = y.shape[1]
    out = torch.empty(N, D, dtype=dtype or y.dtype, device=y.device)
    BD = _row_block(D)
    if N:
        _combine[(N, triton.cdiv(D, BD))](
            y, inv, w if w is not None else inv, out, D, K=inv.shape[1], BD=BD, WEIGHTED=w is not None
        )
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tok, inv):
        ctx.save_for_backward(inv)
        return x[tok]

    @staticmethod
    def backward(ctx, dxp):
        (inv,) = ctx.saved_tensors
        return _combine_rows(dxp.contiguous(), inv, None, inv.shape[0]), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inv, w):
        y, w = y.contiguous(), w.contiguous()
        ctx.save_for_backward(y, inv, w)
        return _combine_rows(y, inv, w, inv.shape[0], torch.promote_types(y.dtype, w.dtype))

    @staticmethod
    def backward(ctx, dout):
        y, inv, w = ctx.saved_tensors
        N, K = inv.shape
        D = y.shape[1]
        dy = torch.empty_like(y)
        dw = torch.empty(N, K, dtype=torch.float32, device=y.device)
        if N:
            _combine_bwd[(N,)](dout.contiguous(), y, inv, w, dy, dw, D, K=K, BD=_row_block(D))
        return dy, None, dw.to(w.dtype)


def permute(x_ND: torch.Tensor, tok_M: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """x's rows in expert order, [M, D] (row m is token tok[m])."""
    return _Permute.apply(x_ND, tok_M, inv_NK.to(torch.int32).contiguous())


def unpermute(y_MD: torch.Tensor, inv_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs, weighted and summed in fp32, [N, D] in the wider of the two
    dtypes (bf16 rows with the router's fp32 weights: fp32, as y * w would be)."""
    return _Unpermute.apply(y_MD, inv_NK.to(torch.int32).contiguous(), w_NK)
