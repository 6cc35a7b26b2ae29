"""The experts' data movement and activation in Triton: ``permute`` / ``unpermute``, the (token,
slot) pairs in expert order and back; ``swiglu_rows``, the activation on the gate/up product's
rows, each row weighed by its routing weight, in one pass each way (autograd's composition makes
seven: silu, mul, the weighting, and in the backward the muls, silu's backward, the weight's row
sums and the halves' concatenation); ``swiglu``, a dense MLP's on two tensors. The rows come out
of the experts weighed, so the combine only sums each token's k rows, in fp32, one program per
token: no atomics (the result does not depend on scheduling, as ``index_add_``'s does), and its
backward copies rows: nothing of the experts' output is kept for it. ``inv_NK`` is each pair's
row in expert order.

Same signatures as ``reference.py``. (The Triton grouped GEMM that once lived here is in
``kiln_kernels/experimental/grouped_gemm.py``: measured, not used by the engine.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine(Y, INV, OUT, D, K: tl.constexpr, BD: tl.constexpr):
    """OUT[t] = sum_k Y[inv[t, k]], summed in fp32."""
    t, blk = tl.program_id(0), tl.program_id(1)
    d = blk * BD + tl.arange(0, BD)
    ok = d < D
    acc = tl.zeros([BD], tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(INV + t * K + k).to(tl.int64)
        acc += tl.load(Y + pos * D + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + t.to(tl.int64) * D + d, acc.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _spread(DOUT, INV, DY, D, K: tl.constexpr, BD: tl.constexpr):
    """DY[inv[t, k]] = DOUT[t] for every k (a permutation: each row written once), in DY's dtype."""
    t, blk = tl.program_id(0), tl.program_id(1)
    d = blk * BD + tl.arange(0, BD)
    ok = d < D
    g = tl.load(DOUT + t.to(tl.int64) * D + d, mask=ok, other=0.0)
    for k in tl.static_range(K):
        pos = tl.load(INV + t * K + k).to(tl.int64)
        tl.store(DY + pos * D + d, g.to(DY.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu(G, U, WT, H, M, I, S, BM: tl.constexpr, BI: tl.constexpr, WEIGHTED: tl.constexpr):
    """H[m] = w[m] silu(G[m]) U[m] (w = 1 unless WEIGHTED), in fp32, rounded once; G's and U's
    rows S apart (2I: the gate/up product's halves; I: two tensors)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    ok = (rows < M)[:, None] & (cols < I)[None, :]
    at = rows.to(tl.int64)[:, None] * S + cols[None, :]
    g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=ok, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    if WEIGHTED:
        h = h * tl.load(WT + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    tl.store(H + rows.to(tl.int64)[:, None] * I + cols[None, :], h.to(H.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd(G, U, WT, DH, DG, DU, DW, M, I, S, BM: tl.constexpr, BI: tl.constexpr, WEIGHTED: tl.constexpr):
    """With s = sigmoid(g), (g, u) = (G[m], U[m]) and e = w[m] DH[m] (w = 1 unless WEIGHTED):
    DG[m] = e u s (1 + g (1 - s)), DU[m] = e g s (rows S apart, as G's and U's) and
    DW[m] = DH[m] . silu(g) u (a program takes its rows whole)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    live = rows < M
    w = tl.full([BM, 1], 1.0, tl.float32)
    if WEIGHTED:
        w = tl.load(WT + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    dot = tl.zeros([BM], tl.float32)
    for c0 in range(0, I, BI):
        cols = c0 + tl.arange(0, BI)
        ok = live[:, None] & (cols < I)[None, :]
        at = rows.to(tl.int64)[:, None] * S + cols[None, :]
        g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + at, mask=ok, other=0.0).to(tl.float32)
        dh = tl.load(DH + rows.to(tl.int64)[:, None] * I + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        if WEIGHTED:
            dot += tl.sum(dh * g * s * u, 1)
        e = dh * w
        tl.store(DG + at, (e * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=ok)
        tl.store(DU + at, (e * g * s).to(DU.dtype.element_ty), mask=ok)
    if WEIGHTED:
        tl.store(DW + rows, dot, mask=live)


def _tiles(I: int) -> tuple[int, int]:
    """The (rows, columns) tile of the SwiGLU kernels: ~4096 elements."""
    BI = _row_block(I)
    return max(1, 4096 // BI), BI


def _forward(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor | None, M: int, I: int, S: int) -> torch.Tensor:
    h = g.new_empty(M, I)
    if M and I:
        BM, BI = _tiles(I)
        wt = w.contiguous() if w is not None else g
        _swiglu[(triton.cdiv(M, BM), triton.cdiv(I, BI))](g, u, wt, h, M, I, S, BM=BM, BI=BI, WEIGHTED=w is not None)
    return h


def _backward(g, u, w, dh, dg, du, M: int, I: int, S: int) -> torch.Tensor | None:
    dw = torch.zeros(M, dtype=torch.float32, device=g.device) if w is not None else None
    if M and I:
        BM, BI = _tiles(I)
        wt = w.contiguous() if w is not None else g
        _swiglu_bwd[(triton.cdiv(M, BM),)](
            g,
            u,
            wt,
            dh.contiguous(),
            dg,
            du,
            dw if dw is not None else g,
            M,
            I,
            S,
            BM=BM,
            BI=BI,
            WEIGHTED=w is not None,
        )
    return dw


def swiglu_forward(gu_M2I: torch.Tensor, w_M: torch.Tensor | None = None) -> torch.Tensor:
    """[M, 2I] -> [M, I] (``reference.swiglu_rows``), no autograd: the experts' Function calls it."""
    gu = gu_M2I.contiguous()
    I = gu.shape[1] // 2
    return _forward(gu, gu[:, I:], w_M, gu.shape[0], I, 2 * I)


def swiglu_backward(
    gu_M2I: torch.Tensor, dh_MI: torch.Tensor, w_M: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of ``swiglu_forward`` at (``gu_M2I``, ``w_M``) for the output's gradient
    ``dh_MI``: [M, 2I] in gu's dtype, and [M] in fp32 (None without weights)."""
    gu = gu_M2I.contiguous()
    M, I = dh_MI.shape
    dgu = torch.empty_like(gu)
    dw = _backward(gu, gu[:, I:], w_M, dh_MI, dgu, dgu[:, I:], M, I, 2 * I)
    return dgu, dw


class _Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, w):
        ctx.save_for_backward(gu, w)
        return swiglu_forward(gu, w)

    @staticmethod
    def backward(ctx, dh):
        gu, w = ctx.saved_tensors
        dgu, dw = swiglu_backward(gu, dh, w)
        return dgu, dw.to(w.dtype) if dw is not None else None


class _Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        g, u = g.contiguous(), u.contiguous()
        ctx.save_for_backward(g, u)
        I = g.shape[-1]
        return _forward(g, u, None, g.numel() // max(I, 1), I, I).view(g.shape)

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        dg, du = torch.empty_like(g), torch.empty_like(u)
        I = g.shape[-1]
        _backward(g, u, None, dh, dg, du, g.numel() // max(I, 1), I, I)
        return dg, du


def swiglu_rows(gu_M2I: torch.Tensor, w_M: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of each row's halves, weighed by ``w_M``, [M, 2I] -> [M, I]
    (``reference.swiglu_rows``), with its gradients; in fp32, rounded once to gu's dtype."""
    return _Rows.apply(gu_M2I, w_M)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of two tensors of one shape (a dense MLP's, ``reference.swiglu``), with its
    gradients; in fp32, rounded once to their dtype (gate's and up's, the same)."""
    return _Pair.apply(gate, up)


def _row_block(D: int) -> int:
    """The slice of a row [D] one program step handles."""
    return min(1024, triton.next_power_of_2(D))


def _combine_rows(y: torch.Tensor, inv: torch.Tensor, N: int, dtype: torch.dtype) -> torch.Tensor:
    D = y.shape[1]
    out = torch.empty(N, D, dtype=dtype, device=y.device)
    BD = _row_block(D)
    if N:
        _combine[(N, triton.cdiv(D, BD))](y, inv, out, D, K=inv.shape[1], BD=BD)
    return out


def _spread_rows(dout: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, K = inv.shape
    D = dout.shape[1]
    dy = torch.empty(N * K, D, dtype=dtype, device=dout.device)
    BD = _row_block(D)
    if N:
        _spread[(N, triton.cdiv(D, BD))](dout.contiguous(), inv, dy, D, K=K, BD=BD)
    return dy


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tok, inv):
        ctx.save_for_backward(inv)
        return x[tok]

    @staticmethod
    def backward(ctx, dxp):
        (inv,) = ctx.saved_tensors
        return _combine_rows(dxp.contiguous(), inv, inv.shape[0], dxp.dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inv):
        ctx.save_for_backward(inv)
        ctx.dtype = y.dtype
        return _combine_rows(y.contiguous(), inv, inv.shape[0], torch.promote_types(y.dtype, torch.float32))

    @staticmethod
    def backward(ctx, dout):
        (inv,) = ctx.saved_tensors
        return _spread_rows(dout, inv, ctx.dtype), None


def permute(x_ND: torch.Tensor, tok_M: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """x's rows in expert order, [M, D] (row m is token tok[m])."""
    return _Permute.apply(x_ND, tok_M, inv_NK.to(torch.int32).contiguous())


def unpermute(y_MD: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """Each token's k expert rows (weighed already) summed in fp32, [N, D] in fp32 (or wider)."""
    return _Unpermute.apply(y_MD, inv_NK.to(torch.int32).contiguous())
