"""KDA's forward kernels (the plan is in triton.py's docstring): ``_cumsum`` (Gamma, and dg
reversed), ``_intra`` (A_qk, A_kk), ``_solve`` ((I + A_kk)^-1), ``_wu`` (W, U, the decayed keys
and queries), ``_states`` (the chunks in order: S, V'), ``_output``."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln_kernels.kda.tiles import (
    _beta,
    _block,
    _block_row,
    _chunk_of,
    _dot,
    _earlier_keys,
    _gamma,
    _lower,
    _mm,
    _operand_v,
    _put,
    _put_square,
    _put_v,
    _row,
    _rows,
    _spanned,
    _square,
    _state_ptrs,
    _tile,
    _tile_v,
    _unit_inverse_row,
    _walk,
)


@triton.jit
def _cumsum(X, Y, CHUNKS, H, K, BK: tl.constexpr, REVERSE: tl.constexpr):
    """Y = the chunk-local (reverse) cumulative sum of X along the tokens."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, rows, ok, last = _rows(CHUNKS, c)
    x = _tile(X, rows, ok, h, H, K, BK)
    _put(Y, tl.cumsum(x, 0, reverse=REVERSE), rows, ok, h, H, K, BK)


@triton.jit
def _intra(
    Q,
    Kt,
    BETA,
    G,
    AQK,
    AKK,
    CHUNKS,
    scale,
    H,
    K,
    BK: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
    SPAN: tl.constexpr,
):
    """Row block X of A_qk (j <= i) and A_kk (beta_i, j < i) of one chunk and head: the earlier
    blocks as factored products; the diagonal block as one too where its decay allows
    (``_spanned``), else column by column (written straight out, zeros above the diagonal)."""
    cx, h = tl.program_id(0), tl.program_id(1)
    c, X = cx // 4, cx % 4
    bos, _, _, last = _rows(CHUNKS, c)
    row0 = bos + X * 16
    if row0 > last:
        return
    i16 = tl.arange(0, 16)
    rX, okX, gX, g_r, qX, kX, bX = _block(Q, Kt, BETA, G, row0, last, h, H, scale, K, 0, BK)
    dX = tl.exp(gX - g_r[None, :])
    aq = qX * dX
    ak = kX * dX
    for J in range(0, X):
        kJ = _earlier_keys(Kt, G, bos + J * 16, last, g_r, h, H, K, 0, BK)
        _put_square(AQK, _dot(aq, tl.trans(kJ), DT, PREC), rX, okX, h, H, J * 16, 16)
        _put_square(AKK, _dot(ak, tl.trans(kJ), DT, PREC) * bX[:, None], rX, okX, h, H, J * 16, 16)
    _, fits = _spanned(G, row0, last, g_r, h, H, K, 0, BK, SPAN)
    if fits:
        kb = tl.trans(kX * tl.exp(g_r[None, :] - gX))
        # fp32 operands (tf32 for bf16 inputs, as fla's): bf16 costs the factors' products precision
        _put_square(
            AQK, tl.where(i16[None, :] <= i16[:, None], _dot(aq, kb, tl.float32, PREC), 0.0), rX, okX, h, H, X * 16, 16
        )
        _put_square(
            AKK,
            tl.where(i16[None, :] < i16[:, None], _dot(ak, kb, tl.float32, PREC), 0.0) * bX[:, None],
            rX,
            okX,
            h,
            H,
            X * 16,
            16,
        )
    else:
        base = (rX.to(tl.int64) * H + h) * 64 + X * 16
        for j in range(16):
            rj = tl.minimum(row0 + j, last)
            kj = tl.where(row0 + j <= last, _row(Kt, rj, h, H, K, 0, BK), 0.0)
            e = tl.exp(tl.where(i16[:, None] >= j, gX - _row(G, rj, h, H, K, 0, BK)[None, :], float("-inf")))
            tl.store(AQK + base + j, tl.sum(qX * kj[None, :] * e, 1).to(AQK.dtype.element_ty), mask=okX)
            colk = tl.sum(kX * kj[None, :] * tl.where(i16[:, None] > j, e, 0.0), 1) * bX
            tl.store(AKK + base + j, colk, mask=okX)


@triton.jit
def _solve(AKK, MI, CHUNKS, H):
    """Mi = (I + A_kk)^-1 by blocks of 16: the four diagonal blocks D_X by forward substitution
    (side by side; each step's row of A read from memory, not picked out of a tile by a sum), then
    Mi_XJ = -D_X sum_{J <= L < X} A_XL Mi_LJ; into MI (the lower triangle)."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, _, _, last = _rows(CHUNKS, c)
    end = last + 1
    i16 = tl.arange(0, 16)
    r0, r1, r2, r3 = bos + i16, bos + 16 + i16, bos + 32 + i16, bos + 48 + i16
    k0, k1, k2, k3 = r0 < end, r1 < end, r2 < end, r3 < end
    D0 = tl.where(i16[:, None] == i16[None, :], 1.0, 0.0)
    D1, D2, D3 = D0, D0, D0
    for r in range(1, 16):
        D0 = _unit_inverse_row(D0, _block_row(AKK, bos + r, end, h, H, 0, r, i16), r, i16)
        D1 = _unit_inverse_row(D1, _block_row(AKK, bos + 16 + r, end, h, H, 16, r, i16), r, i16)
        D2 = _unit_inverse_row(D2, _block_row(AKK, bos + 32 + r, end, h, H, 32, r, i16), r, i16)
        D3 = _unit_inverse_row(D3, _block_row(AKK, bos + 48 + r, end, h, H, 48, r, i16), r, i16)
    A10 = _square(AKK, r1, k1, h, H, 0, 16)
    A20, A21 = _square(AKK, r2, k2, h, H, 0, 16), _square(AKK, r2, k2, h, H, 16, 16)
    A30, A31, A32 = (
        _square(AKK, r3, k3, h, H, 0, 16),
        _square(AKK, r3, k3, h, H, 16, 16),
        _square(AKK, r3, k3, h, H, 32, 16),
    )
    M10 = -_mm(D1, _mm(A10, D0))
    M21 = -_mm(D2, _mm(A21, D1))
    M32 = -_mm(D3, _mm(A32, D2))
    M20 = -_mm(D2, _mm(A20, D0) + _mm(A21, M10))
    M31 = -_mm(D3, _mm(A31, D1) + _mm(A32, M21))
    M30 = -_mm(D3, _mm(A30, D0) + _mm(A31, M10) + _mm(A32, M20))
    _put_square(MI, D0, r0, k0, h, H, 0, 16)
    _put_square(MI, M10, r1, k1, h, H, 0, 16)
    _put_square(MI, D1, r1, k1, h, H, 16, 16)
    _put_square(MI, M20, r2, k2, h, H, 0, 16)
    _put_square(MI, M21, r2, k2, h, H, 16, 16)
    _put_square(MI, D2, r2, k2, h, H, 32, 16)
    _put_square(MI, M30, r3, k3, h, H, 0, 16)
    _put_square(MI, M31, r3, k3, h, H, 16, 16)
    _put_square(MI, M32, r3, k3, h, H, 32, 16)
    _put_square(MI, D3, r3, k3, h, H, 48, 16)


@triton.jit
def _wu(
    Q,
    Kt,
    V,
    BETA,
    G,
    MI,
    W,
    U,
    KD,
    QG,
    CHUNKS,
    scale,
    H,
    K,
    VD,
    BW: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """W = Mi (beta e^Gamma k), U = Mi (beta v) of one chunk, head and block of BW columns (of K
    for W, of V for U); and the decayed keys and queries the chunk-by-chunk kernels multiply with,
    KD = k e^(Gamma_C - Gamma), QG = q e^Gamma (scaled), so that no exponential of a tile is left
    on their sequential path. Each column block is a product of its own (Mi loaded again)."""
    c, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d0 = j * BW
    bos, rows, ok, last = _rows(CHUNKS, c)
    Mi = _lower(MI, rows, ok, h, H)
    b = _beta(BETA, rows, ok, h, H)
    if d0 < K:
        k = _tile_v(Kt, rows, ok, h, H, K, d0, BW)
        gm = _gamma(G, rows, ok, last, h, H, K, d0, BW)
        eg = tl.exp(gm)
        _put_v(KD, k * tl.exp(_row(G, last, h, H, K, d0, BW)[None, :] - gm), rows, ok, h, H, K, d0, BW)
        _put_v(QG, _tile_v(Q, rows, ok, h, H, K, d0, BW) * scale * eg, rows, ok, h, H, K, d0, BW)
        _put_v(W, _dot(Mi, k * eg * b[:, None], DT, PREC), rows, ok, h, H, K, d0, BW)
    if d0 < VD:
        u = _dot(Mi, _tile_v(V, rows, ok, h, H, VD, d0, BW) * b[:, None], DT, PREC)
        _put_v(U, u, rows, ok, h, H, VD, d0, BW)


@triton.jit
def _states(
    KD,
    W,
    U,
    G,
    H0,
    HS,
    VN,
    HT,
    CHUNKS,
    SEQ,
    H,
    K,
    VD,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Per sequence, head and block of V, the chunks in order: HS[c] = the state at chunk c's
    start, VN = U - W S; the final state into HT. The state's rows in two halves of K, each its own
    accumulator, and W and KD loaded in their own dtype: operands that go straight into products
    are copied ahead of the loop's step (10 asynchronous copies a step for sm_90a, against 4 with
    one fp32 state beside fp32 operand tiles: bench/regs.py)."""
    n, h, v0, _, c0, c1, s0, s1 = _walk(H0, HAS_H0, SEQ, H, K, VD, BK, BV)
    HK: tl.constexpr = BK // 2 if BK >= 32 else 16  # a product's inner size is 16 at least
    a0, b0 = _state_ptrs(H0, n, h, H, K, VD, 0, v0, HK, BV)
    a1, b1 = _state_ptrs(H0, n, h, H, K, VD, HK, v0, HK, BV)
    S0 = tl.load(a0, mask=b0 & HAS_H0, other=0.0).to(tl.float32)
    S1 = tl.load(a1, mask=b1 & HAS_H0, other=0.0).to(tl.float32)
    for c in range(c0, c1):
        p0, m0 = _state_ptrs(HS, c, h, H, K, VD, 0, v0, HK, BV)
        p1, m1 = _state_ptrs(HS, c, h, H, K, VD, HK, v0, HK, BV)
        tl.store(p0, S0.to(HS.dtype.element_ty), mask=m0)
        tl.store(p1, S1.to(HS.dtype.element_ty), mask=m1)
        bos, rows, ok, last = _chunk_of(c, c0, s0, s1)
        w0, w1 = _operand_v(W, rows, ok, h, H, K, 0, HK), _operand_v(W, rows, ok, h, H, K, HK, HK)
        vn = _tile_v(U, rows, ok, h, H, VD, v0, BV) - _dot(w0, S0, DT, PREC) - _dot(w1, S1, DT, PREC)
        _put_v(VN, vn, rows, ok, h, H, VD, v0, BV)
        k0, k1 = _operand_v(KD, rows, ok, h, H, K, 0, HK), _operand_v(KD, rows, ok, h, H, K, HK, HK)
        S0 = S0 * tl.exp(_row(G, last, h, H, K, 0, HK))[:, None] + _dot(tl.trans(k0), vn, DT, PREC)
        S1 = S1 * tl.exp(_row(G, last, h, H, K, HK, HK))[:, None] + _dot(tl.trans(k1), vn, DT, PREC)
    a0, b0 = _state_ptrs(HT, n, h, H, K, VD, 0, v0, HK, BV)
    a1, b1 = _state_ptrs(HT, n, h, H, K, VD, HK, v0, HK, BV)
    tl.store(a0, S0, mask=b0)
    tl.store(a1, S1, mask=b1)


@triton.jit
def _output(
    QG, AQK, HS, VN, O, CHUNKS, H, K, VD, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr
):
    """O = (q e^Gamma) S + A_qk V' for one chunk, head and block of V."""
    c, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    v0 = vb * BV
    bos, rows, ok, last = _rows(CHUNKS, c)
    d, e = tl.arange(0, BK), v0 + tl.arange(0, BV)
    # the chunk's state: the rows' offsets from an int64 base, the columns added after. Written so
    # for triton-ascend 3.2, whose TritonToUnstructure pass segfaults now and then on some forms of
    # this load: an int32 tile of offsets on the int64 base (2% of fp32 compiles), _state_ptrs'
    # int64 tile (0.7-3% of bf16 ones); this form 0 of 1,000 in each dtype. ptxas (sm_90a, the
    # launcher's hints): 126 registers at CONFIG's launch, as the int32 tile, 125 _state_ptrs'
    S = tl.load(
        HS + ((c * H + h).to(tl.int64) * K * VD + d[:, None] * VD) + e[None, :],
        mask=(d[:, None] < K) & (e[None, :] < VD),
        other=0.0,
    )
    o = _dot(_tile(QG, rows, ok, h, H, K, BK), S, DT, PREC)
    o += _dot(_lower(AQK, rows, ok, h, H), _tile_v(VN, rows, ok, h, H, VD, v0, BV), DT, PREC)
    _put_v(O, o, rows, ok, h, H, VD, v0, BV)
