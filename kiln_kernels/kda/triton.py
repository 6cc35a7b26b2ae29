"""KDA's chunked form in Triton, forward and backward; the signature of ``reference.kda_chunk``.

Sequences (``cu_seqlens``, or the batch's rows) are cut into chunks of C = 64 tokens that never
straddle two sequences. Per (chunk, head), with Gamma = cumsum(g) inside the chunk:

- forward: ``_cumsum`` (Gamma), ``_intra`` (A_qk, A_kk; a program per 16-row block), ``_solve``
  ((I + A_kk)^-1 by blocks), ``_wu`` (W, U, the decayed keys and queries), ``_states`` (the chunks
  in order per sequence and head: the state at each chunk's start, V' = U - W S), ``_output``
  (O = (Q e^Gamma) S + A_qk V');
- backward: A_qk and the inverse come from the forward; ``_cumsum``, ``_wu`` and ``_states`` again,
  ``_dstates`` (the chunks in reverse: dS at each chunk's end, dV'), ``_dlocal`` (every gradient
  that needs S, dS, V' or the inverse, and dA_qk, dA_kk), ``_dintra`` (the gradients through
  A_qk and A_kk; a program per 16-row block and 64 columns of K), then ``_cumsum`` reversed turns
  dGamma into dg. No atomics: deterministic.

A_qk[i, j] = sum_d q_id k_jd e^(Gamma_id - Gamma_jd) (j <= i) has a decay per channel, so it is no
plain product. In blocks of 16 rows it is: for a row block X and an earlier block J, with r the
first row of X, (q_X e^(Gamma_X - Gamma_r)) (k_J e^(Gamma_r - Gamma_J))^T, both factors <= 1 as
g <= 0 (a product on the tensor cores, no overflow whatever the decay). Inside X the same split
has a factor e^(Gamma_r - Gamma_j) >= 1: a product where X's decay spans less than e^SPAN
(``_spanned``), else a loop over X's 16 tokens. A_kk is the same with beta_i k_i for q_i and j < i.

Legend as in reference.py; R = B * T rows. What only feeds products or sums at the inputs'
precision (A_qk, the inverse, W, U, V', dV', the chunk states, the output) is stored in the
inputs' dtype, the rest in fp32 (Gamma, the final state, dS, the gradients until their last
write); the products take their operands in the inputs' dtype (bf16 tensor cores for bf16
inputs, IEEE fp32 for fp32) and sum in fp32, except the inverse's (IEEE fp32), the diagonal
blocks' (fp32 operands: tf32 forward, IEEE backward) and ``_dintra``'s (tf32 for bf16 inputs):
there bf16 rounding does not cancel where dGamma's terms do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_kernels.dispatch import dot_precision, kept, to_device
from kiln_kernels.kda.reference import segments

C = 64  # chunk


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """a b with fp32 sums, the operands rounded to the inputs' dtype (bf16 runs on bf16 tensor cores)."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _rows(CHUNKS, c):
    """Chunk c's first row, its rows 0..C-1, which of them are in the sequence, and the last one."""
    bos = tl.load(CHUNKS + 2 * c)
    end = tl.load(CHUNKS + 2 * c + 1)
    rows = bos + tl.arange(0, 64)
    return bos, rows, rows < end, end - 1


@triton.jit
def _tile_v(P, rows, ok, h, H, D, d0, BD: tl.constexpr):
    """[rows, columns d0..d0+BD) of head h from a [R, H, D] tensor, fp32; zeros outside."""
    d = d0 + tl.arange(0, BD)
    return tl.load(
        P + (rows[:, None].to(tl.int64) * H + h) * D + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0
    ).to(tl.float32)


@triton.jit
def _put_v(P, x, rows, ok, h, H, D, d0, BD: tl.constexpr):
    d = d0 + tl.arange(0, BD)
    tl.store(
        P + (rows[:, None].to(tl.int64) * H + h) * D + d[None, :],
        x.to(P.dtype.element_ty),
        mask=ok[:, None] & (d[None, :] < D),
    )


@triton.jit
def _tile(P, rows, ok, h, H, D, BD: tl.constexpr):
    """All of a row's D columns (BD >= D)."""
    return _tile_v(P, rows, ok, h, H, D, 0, BD)


@triton.jit
def _put(P, x, rows, ok, h, H, D, BD: tl.constexpr):
    _put_v(P, x, rows, ok, h, H, D, 0, BD)


@triton.jit
def _row(P, row, h, H, D, d0, BD: tl.constexpr):
    """Columns d0..d0+BD of one row of head h, fp32."""
    d = d0 + tl.arange(0, BD)
    return tl.load(P + (row.to(tl.int64) * H + h) * D + d, mask=d < D, other=0.0).to(tl.float32)


@triton.jit
def _gamma(G, rows, ok, last, h, H, K, d0, BK: tl.constexpr):
    """Gamma on rows; rows past the sequence take the last row's (finite differences, no overflow)."""
    x = _tile_v(G, rows, ok, h, H, K, d0, BK)
    return tl.where(ok[:, None], x, _row(G, last, h, H, K, d0, BK)[None, :])


@triton.jit
def _square(P, rows, ok, h, H, cols0, NC: tl.constexpr):
    """[rows, NC] of head h from a [R, H, 64] matrix of chunk rows, columns cols0..cols0+NC, fp32."""
    c = cols0 + tl.arange(0, NC)
    return tl.load(P + (rows[:, None].to(tl.int64) * H + h) * 64 + c[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )


@triton.jit
def _put_square(P, x, rows, ok, h, H, cols0, NC: tl.constexpr):
    c = cols0 + tl.arange(0, NC)
    tl.store(P + (rows[:, None].to(tl.int64) * H + h) * 64 + c[None, :], x.to(P.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _lower(P, rows, ok, h, H):
    """A chunk's [64, 64] lower triangle with the diagonal, zeros above."""
    i = tl.arange(0, 64)
    return tl.where(i[None, :] <= i[:, None], _square(P, rows, ok, h, H, 0, 64), 0.0)


@triton.jit
def _cumsum(X, Y, CHUNKS, H, K, BK: tl.constexpr, REVERSE: tl.constexpr):
    """Y = the chunk-local (reverse) cumulative sum of X along the tokens."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, rows, ok, last = _rows(CHUNKS, c)
    x = _tile(X, rows, ok, h, H, K, BK)
    _put(Y, tl.cumsum(x, 0, reverse=REVERSE), rows, ok, h, H, K, BK)


@triton.jit
def _beta(BETA, rows, ok, h, H):
    return tl.load(BETA + rows.to(tl.int64) * H + h, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _block(Q, Kt, BETA, G, row0, last, h, H, scale, K, d0, BK: tl.constexpr):
    """Row block [row0, row0 + 16) of a chunk, columns d0..d0+BK: its rows and which are in the
    sequence, Gamma, Gamma at its first row (the reference of the factored products), q (scaled),
    k and beta."""
    rows = row0 + tl.arange(0, 16)
    ok = rows <= last
    g = _gamma(G, rows, ok, last, h, H, K, d0, BK)
    g_r = _row(G, tl.minimum(row0, last), h, H, K, d0, BK)
    q = _tile_v(Q, rows, ok, h, H, K, d0, BK) * scale
    return rows, ok, g, g_r, q, _tile_v(Kt, rows, ok, h, H, K, d0, BK), _beta(BETA, rows, ok, h, H)


@triton.jit
def _earlier_keys(Kt, G, row0, last, g_r, h, H, K, d0, BK: tl.constexpr):
    """k_J e^(Gamma_r - Gamma_J) on the row block [row0, row0 + 16) before the reference row r:
    the earlier block's factor of the split products (<= 1)."""
    rows = row0 + tl.arange(0, 16)
    ok = rows <= last
    return _tile_v(Kt, rows, ok, h, H, K, d0, BK) * tl.exp(g_r[None, :] - _gamma(G, rows, ok, last, h, H, K, d0, BK))


@triton.jit
def _column(P, rows, ok, h, H, col):
    """Column col of a [R, H, 64] chunk matrix on rows."""
    return tl.load(P + (rows.to(tl.int64) * H + h) * 64 + col, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _spanned(G, row0, last, g_r, h, H, K, d0, BK: tl.constexpr, SPAN: tl.constexpr):
    """Gamma at the row block's last row, and whether the block's decay (Gamma_r - Gamma_last, the
    largest over its channels) is under SPAN: then e^(Gamma_r - Gamma_j) <= e^SPAN and its inverse
    stay finite and normal in the products' dtype, and the diagonal block is a product too."""
    g_n = _row(G, tl.minimum(row0 + 15, last), h, H, K, d0, BK)
    return g_n, tl.max(g_r - g_n, 0) < SPAN


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
def _unit_inverse_row(D, A, r, i16):
    """Forward substitution's step r on a 16 x 16 unit lower-triangular inverse: row r of D becomes
    e_r - sum_j A_rj D_j (rows j < r are final)."""
    a_r = tl.sum(tl.where(i16[:, None] == r, A, 0.0), 0)
    return tl.where(i16[:, None] == r, D - tl.sum(a_r[:, None] * D, 0)[None, :], D)


@triton.jit
def _mm(a, b):
    """fp32 products for the inverse (fla's tril solve keeps IEEE fp32 too)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _solve(AKK, MI, CHUNKS, H):
    """Mi = (I + A_kk)^-1 by blocks of 16: the four diagonal blocks D_X by forward substitution
    (side by side), then Mi_XJ = -D_X sum_{J <= L < X} A_XL Mi_LJ; into MI (the lower triangle)."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, _, _, last = _rows(CHUNKS, c)
    end = last + 1
    i16 = tl.arange(0, 16)
    r0, r1, r2, r3 = bos + i16, bos + 16 + i16, bos + 32 + i16, bos + 48 + i16
    k0, k1, k2, k3 = r0 < end, r1 < end, r2 < end, r3 < end
    low = i16[None, :] < i16[:, None]
    A00 = tl.where(low, _square(AKK, r0, k0, h, H, 0, 16), 0.0)
    A11 = tl.where(low, _square(AKK, r1, k1, h, H, 16, 16), 0.0)
    A22 = tl.where(low, _square(AKK, r2, k2, h, H, 32, 16), 0.0)
    A33 = tl.where(low, _square(AKK, r3, k3, h, H, 48, 16), 0.0)
    D0 = tl.where(i16[:, None] == i16[None, :], 1.0, 0.0)
    D1, D2, D3 = D0, D0, D0
    for r in range(1, 16):
        D0 = _unit_inverse_row(D0, A00, r, i16)
        D1 = _unit_inverse_row(D1, A11, r, i16)
        D2 = _unit_inverse_row(D2, A22, r, i16)
        D3 = _unit_inverse_row(D3, A33, r, i16)
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
    BK: tl.constexpr,
    BV: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """W = Mi (beta e^Gamma k), U = Mi (beta v) of one chunk and head; and the decayed keys and
    queries the chunk-by-chunk kernels multiply with, KD = k e^(Gamma_C - Gamma), QG = q e^Gamma
    (scaled), so that no exponential of a tile is left on their sequential path."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, rows, ok, last = _rows(CHUNKS, c)
    Mi = _lower(MI, rows, ok, h, H)
    b = _beta(BETA, rows, ok, h, H)
    k = _tile(Kt, rows, ok, h, H, K, BK)
    gm = _gamma(G, rows, ok, last, h, H, K, 0, BK)
    eg = tl.exp(gm)
    _put(KD, k * tl.exp(_row(G, last, h, H, K, 0, BK)[None, :] - gm), rows, ok, h, H, K, BK)
    _put(QG, _tile(Q, rows, ok, h, H, K, BK) * scale * eg, rows, ok, h, H, K, BK)
    _put(W, _dot(Mi, k * eg * b[:, None], DT, PREC), rows, ok, h, H, K, BK)
    _put(U, _dot(Mi, _tile(V, rows, ok, h, H, VD, BV) * b[:, None], DT, PREC), rows, ok, h, H, VD, BV)


@triton.jit
def _state_ptrs(P, n, h, H, K, VD, d0, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Rows d0..d0+BK, columns v0..v0+BV of state n, head h, from [N, H, K, V], and the mask."""
    d = d0 + tl.arange(0, BK)
    e = v0 + tl.arange(0, BV)
    return P + ((n * H + h).to(tl.int64) * K + d[:, None]) * VD + e[None, :], (d[:, None] < K) & (e[None, :] < VD)


@triton.jit
def _walk(P0, HAS: tl.constexpr, SEQ, H, K, VD, BK: tl.constexpr, BV: tl.constexpr):
    """A chunk-by-chunk program's sequence n, head h and first column v0 of V, the state it starts
    from (P0's, zeros without HAS), its chunks [c0, c1) and rows [s0, s1) (SEQ: [N + 1, 2], each
    sequence's first chunk and first row)."""
    vb, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    v0 = vb * BV
    p0, m0 = _state_ptrs(P0, n, h, H, K, VD, 0, v0, BK, BV)
    return (
        n,
        h,
        v0,
        tl.load(p0, mask=m0 & HAS, other=0.0).to(tl.float32),
        tl.load(SEQ + 2 * n),
        tl.load(SEQ + 2 * n + 2),
        tl.load(SEQ + 2 * n + 1),
        tl.load(SEQ + 2 * n + 3),
    )


@triton.jit
def _chunk_of(c, c0, s0, s1):
    """Chunk c of a sequence whose first chunk is c0 and rows [s0, s1), as ``_rows`` gives it, but
    computed, not read: the chunk-by-chunk loops' addresses do not wait on a load."""
    bos = s0 + (c - c0) * 64
    end = tl.minimum(bos + 64, s1)
    rows = bos + tl.arange(0, 64)
    return bos, rows, rows < end, end - 1


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
    start, VN = U - W S; the final state into HT."""
    n, h, v0, S, c0, c1, s0, s1 = _walk(H0, HAS_H0, SEQ, H, K, VD, BK, BV)
    for c in range(c0, c1):
        p, m = _state_ptrs(HS, c, h, H, K, VD, 0, v0, BK, BV)
        tl.store(p, S.to(HS.dtype.element_ty), mask=m)
        bos, rows, ok, last = _chunk_of(c, c0, s0, s1)
        vn = _tile_v(U, rows, ok, h, H, VD, v0, BV) - _dot(_tile(W, rows, ok, h, H, K, BK), S, DT, PREC)
        _put_v(VN, vn, rows, ok, h, H, VD, v0, BV)
        S = S * tl.exp(_row(G, last, h, H, K, 0, BK))[:, None] + _dot(
            tl.trans(_tile(KD, rows, ok, h, H, K, BK)), vn, DT, PREC
        )
    p, m = _state_ptrs(HT, n, h, H, K, VD, 0, v0, BK, BV)
    tl.store(p, S, mask=m)


@triton.jit
def _output(
    QG, AQK, HS, VN, O, CHUNKS, H, K, VD, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr
):
    """O = (q e^Gamma) S + A_qk V' for one chunk, head and block of V."""
    c, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    v0 = vb * BV
    bos, rows, ok, last = _rows(CHUNKS, c)
    p, m = _state_ptrs(HS, c, h, H, K, VD, 0, v0, BK, BV)
    o = _dot(_tile(QG, rows, ok, h, H, K, BK), tl.load(p, mask=m, other=0.0), DT, PREC)
    o += _dot(_lower(AQK, rows, ok, h, H), _tile_v(VN, rows, ok, h, H, VD, v0, BV), DT, PREC)
    _put_v(O, o, rows, ok, h, H, VD, v0, BV)


@triton.jit
def _dstates(
    QG,
    KD,
    G,
    W,
    AQK,
    DO,
    DHT,
    DH,
    DVN,
    DH0,
    CHUNKS,
    SEQ,
    H,
    K,
    VD,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DHT: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """The chunks in reverse: DH[c] = dS at chunk c's end; dV' = A_qk^T dO + (k e^(Gamma_C - Gamma)) dS;
    dS at the chunk's start = (q e^Gamma)^T dO + e^Gamma_C dS - W^T dV'. The first into DH0."""
    n, h, v0, dS, c0, c1, s0, s1 = _walk(DHT, HAS_DHT, SEQ, H, K, VD, BK, BV)
    for cc in range(c0, c1):
        c = c1 - 1 - (cc - c0)
        p, m = _state_ptrs(DH, c, h, H, K, VD, 0, v0, BK, BV)
        tl.store(p, dS, mask=m)
        bos, rows, ok, last = _chunk_of(c, c0, s0, s1)
        do = _tile_v(DO, rows, ok, h, H, VD, v0, BV)
        dvn = _dot(tl.trans(_lower(AQK, rows, ok, h, H)), do, DT, PREC)
        dvn += _dot(_tile(KD, rows, ok, h, H, K, BK), dS, DT, PREC)
        _put_v(DVN, dvn, rows, ok, h, H, VD, v0, BV)
        dS = dS * tl.exp(_row(G, last, h, H, K, 0, BK))[:, None] + _dot(
            tl.trans(_tile(QG, rows, ok, h, H, K, BK)), do, DT, PREC
        )
        dS -= _dot(tl.trans(_tile(W, rows, ok, h, H, K, BK)), dvn, DT, PREC)
    p, m = _state_ptrs(DH0, n, h, H, K, VD, 0, v0, BK, BV)
    tl.store(p, dS, mask=m)


@triton.jit
def _dlocal(
    Q,
    Kt,
    V,
    BETA,
    G,
    MI,
    VN,
    DVN,
    DO,
    HS,
    DH,
    DQ,
    DK,
    DV,
    DB,
    DG,
    DAQK,
    DAKK,
    CHUNKS,
    scale,
    H,
    K,
    VD,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Per chunk and head, the gradients through everything but A_qk and A_kk (whose gradients
    it writes): q (through q e^Gamma S), k (through the state update and W), v and beta (through
    W and U), Gamma; dq is of the scaled q. First the V blocks alone (dA_qk, dv, beta's and Mi's
    shares through U), then K in blocks of BK, each over the V blocks again."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, rows, ok, last = _rows(CHUNKS, c)
    b = _beta(BETA, rows, ok, h, H)
    Mi = _lower(MI, rows, ok, h, H)
    dAqk = tl.zeros([64, 64], tl.float32)
    dMi = tl.zeros([64, 64], tl.float32)
    db = tl.zeros([64], tl.float32)
    for v0 in range(0, VD, BV):
        dvn = _tile_v(DVN, rows, ok, h, H, VD, v0, BV)
        v = _tile_v(V, rows, ok, h, H, VD, v0, BV)
        dAqk += _dot(
            _tile_v(DO, rows, ok, h, H, VD, v0, BV), tl.trans(_tile_v(VN, rows, ok, h, H, VD, v0, BV)), DT, PREC
        )  # O = (q e^Gamma) S + A_qk V'
        dvb = _dot(tl.trans(Mi), dvn, DT, PREC)  # V' = U - W S, U = Mi (beta v)
        _put_v(DV, dvb * b[:, None], rows, ok, h, H, VD, v0, BV)
        db += tl.sum(v * dvb, 1)
        dMi += _dot(dvn, tl.trans(v * b[:, None]), DT, PREC)
    _put_square(
        DAQK, tl.where(tl.arange(0, 64)[None, :] <= tl.arange(0, 64)[:, None], dAqk, 0.0), rows, ok, h, H, 0, 64
    )
    for d0 in range(0, K, BK):
        dqg = tl.zeros([64, BK], tl.float32)
        dkd = tl.zeros([64, BK], tl.float32)
        dW = tl.zeros([64, BK], tl.float32)
        SdS = tl.zeros([BK], tl.float32)
        for v0 in range(0, VD, BV):
            vn = _tile_v(VN, rows, ok, h, H, VD, v0, BV)
            dvn = _tile_v(DVN, rows, ok, h, H, VD, v0, BV)
            do = _tile_v(DO, rows, ok, h, H, VD, v0, BV)
            S, dS = _state_tiles(HS, DH, c, h, H, K, VD, d0, v0, BK, BV)
            dqg += _dot(do, tl.trans(S), DT, PREC)
            dkd += _dot(vn, tl.trans(dS), DT, PREC)  # S' = e^Gamma_C S + (k e^(Gamma_C - Gamma))^T V'
            SdS += tl.sum(S * dS, 1)
            dW -= _dot(dvn, tl.trans(S), DT, PREC)  # V' = U - W S
        gm = _gamma(G, rows, ok, last, h, H, K, d0, BK)
        g_last = _row(G, last, h, H, K, d0, BK)
        eg = tl.exp(gm)
        q = _tile_v(Q, rows, ok, h, H, K, d0, BK) * scale
        k = _tile_v(Kt, rows, ok, h, H, K, d0, BK)
        dq = eg * dqg
        dG = q * eg * dqg
        ed = tl.exp(g_last[None, :] - gm)
        dk = ed * dkd
        dG -= k * ed * dkd
        dlast = tl.sum(k * ed * dkd, 0) + SdS * tl.exp(g_last)
        dG += tl.where(rows[:, None] == last, dlast[None, :], 0.0)
        # W = Mi (beta e^Gamma k)
        kb = k * eg * b[:, None]
        dkb = _dot(tl.trans(Mi), dW, DT, PREC)
        dk += eg * b[:, None] * dkb
        dG += kb * dkb
        db += tl.sum(k * eg * dkb, 1)
        dMi += _dot(dW, tl.trans(kb), DT, PREC)
        _put_v(DQ, dq, rows, ok, h, H, K, d0, BK)
        _put_v(DK, dk, rows, ok, h, H, K, d0, BK)
        _put_v(DG, dG, rows, ok, h, H, K, d0, BK)
    # Mi = (I + A_kk)^-1: dA_kk = -Mi^T dMi Mi^T below the diagonal
    dA = -_dot(_dot(tl.trans(Mi), dMi, DT, PREC), tl.trans(Mi), DT, PREC)
    _put_square(DAKK, tl.where(tl.arange(0, 64)[None, :] < tl.arange(0, 64)[:, None], dA, 0.0), rows, ok, h, H, 0, 64)
    tl.store(DB + rows.to(tl.int64) * H + h, db, mask=ok)


@triton.jit
def _state_tiles(HS, DH, c, h, H, K, VD, d0, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Rows d0..d0+BK, columns v0..v0+BV of chunk c's state and its gradient, fp32."""
    p, m = _state_ptrs(HS, c, h, H, K, VD, d0, v0, BK, BV)
    pd, _ = _state_ptrs(DH, c, h, H, K, VD, d0, v0, BK, BV)
    return tl.load(p, mask=m, other=0.0).to(tl.float32), tl.load(pd, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _dintra(
    Q,
    Kt,
    BETA,
    G,
    DAQK,
    DAKK,
    DQ,
    DK,
    DBP,
    DG,
    DQO,
    DKO,
    CHUNKS,
    scale,
    R,
    H,
    K,
    BK: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
    SPAN: tl.constexpr,
):
    """The gradients through A_qk = A(q, k) and A_kk = beta A(k, k), added to ``_dlocal``'s, for
    one row block X of a chunk and columns d0..d0+BK: for A(a, b) with dA,
    da_i = sum_j dA_ij b_j e^(Gamma_i - Gamma_j), db_j = sum_i dA_ij a_i e^(Gamma_i - Gamma_j),
    dGamma_i += a_i da_i, dGamma_j -= b_j db_j. dq and dk leave here final (dq times the scale);
    beta's share (a sum over the columns) goes to DBP[column block]."""
    cx, h, kblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, X = cx // 4, cx % 4
    bos, _, _, last = _rows(CHUNKS, c)
    row0 = bos + X * 16
    if row0 > last:
        return
    d0 = kblock * BK
    i16 = tl.arange(0, 16)
    rX, okX, gX, g_r, qX, kX, bX = _block(Q, Kt, BETA, G, row0, last, h, H, scale, K, d0, BK)
    # a-side, the earlier blocks J: da_X = e^(Gamma_X - Gamma_r) (dA_XJ (b_J e^(Gamma_r - Gamma_J)))
    daq = tl.zeros([16, BK], tl.float32)
    dak = tl.zeros([16, BK], tl.float32)
    for J in range(0, X):
        kJ = _earlier_keys(Kt, G, bos + J * 16, last, g_r, h, H, K, d0, BK)
        daq += _dot(_square(DAQK, rX, okX, h, H, J * 16, 16), kJ, DT, PREC)
        dak += _dot(_square(DAKK, rX, okX, h, H, J * 16, 16), kJ, DT, PREC)
    dX = tl.exp(gX - g_r[None, :])
    daq *= dX
    dak *= dX
    # b-side, the later blocks I, one reference n = X's last row:
    # db_X = e^(Gamma_n - Gamma_X) sum_I dA_IX^T (a_I e^(Gamma_I - Gamma_n))
    g_n, fits = _spanned(G, row0, last, g_r, h, H, K, d0, BK, SPAN)
    dbt = tl.zeros([16, BK], tl.float32)
    for I in range(X + 1, (last - bos) // 16 + 1):
        rI = bos + I * 16 + i16
        okI = rI <= last
        eI = tl.exp(_gamma(G, rI, okI, last, h, H, K, d0, BK) - g_n[None, :])
        qI = _tile_v(Q, rI, okI, h, H, K, d0, BK) * scale * eI
        kI = _tile_v(Kt, rI, okI, h, H, K, d0, BK) * (_beta(BETA, rI, okI, h, H)[:, None] * eI)
        dbt += _dot(tl.trans(_square(DAQK, rI, okI, h, H, X * 16, 16)), qI, DT, PREC)
        dbt += _dot(tl.trans(_square(DAKK, rI, okI, h, H, X * 16, 16)), kI, DT, PREC)
    dbt *= tl.exp(g_n[None, :] - gX)
    # inside X (dA_qk's block is zero above the diagonal, dA_kk's on it too)
    if fits:  # through the reference r: e^(Gamma_i - Gamma_j) = e^(Gamma_i - Gamma_r) e^(Gamma_r - Gamma_j)
        dAq = _square(DAQK, rX, okX, h, H, X * 16, 16)
        dAk = _square(DAKK, rX, okX, h, H, X * 16, 16)
        up = tl.exp(g_r[None, :] - gX)
        k_up = kX * up
        daq += dX * _mm(dAq, k_up)
        dak += dX * _mm(dAk, k_up)
        dbt += up * (_mm(tl.trans(dAq), qX * dX) + _mm(tl.trans(dAk), kX * (bX[:, None] * dX)))
    else:  # token j as key (column j of dA) and as query (row j of dA); e^-|Gamma_i - Gamma_j| serves both
        for j in range(0, tl.minimum(row0 + 15, last) - row0 + 1):
            rj = row0 + j
            gj = _row(G, rj, h, H, K, d0, BK)
            e = tl.exp(tl.where(i16[:, None] >= j, gX - gj[None, :], gj[None, :] - gX))
            e_a = tl.where(i16[:, None] >= j, e, 0.0)
            e_b = tl.where(i16[:, None] <= j, e, 0.0)
            kj = _row(Kt, rj, h, H, K, d0, BK)
            daq += _column(DAQK, rX, okX, h, H, X * 16 + j)[:, None] * kj[None, :] * e_a
            dak += _column(DAKK, rX, okX, h, H, X * 16 + j)[:, None] * kj[None, :] * e_a
            rq = _row(DAQK, rj, h, H, 64, X * 16, 16)
            rk = _row(DAKK, rj, h, H, 64, X * 16, 16)
            qj = _row(Q, rj, h, H, K, d0, BK) * scale
            bj = tl.load(BETA + rj.to(tl.int64) * H + h).to(tl.float32)
            dbt += (rq[:, None] * qj[None, :] + rk[:, None] * (bj * kj)[None, :]) * e_b
    dG = _tile_v(DG, rX, okX, h, H, K, d0, BK) + qX * daq + kX * bX[:, None] * dak - kX * dbt
    _put_v(DG, dG, rX, okX, h, H, K, d0, BK)
    _put_v(DQO, (_tile_v(DQ, rX, okX, h, H, K, d0, BK) + daq) * scale, rX, okX, h, H, K, d0, BK)
    _put_v(DKO, _tile_v(DK, rX, okX, h, H, K, d0, BK) + bX[:, None] * dak + dbt, rX, okX, h, H, K, d0, BK)
    tl.store(DBP + kblock.to(tl.int64) * R * H + rX.to(tl.int64) * H + h, tl.sum(kX * dak, 1), mask=okX)


def _chunks(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's [first row, end), and [N + 1, 2]: each sequence's first chunk and first row
    (then the totals)."""
    spans, seq = [], [(0, 0)]
    for a, b in zip(cu, cu[1:], strict=False):
        spans += [(s, min(s + C, b)) for s in range(a, b, C)]
        seq.append((len(spans), b))
    return to_device(torch.tensor(spans or [(0, 0)], dtype=torch.int32).flatten(), device), to_device(
        torch.tensor(seq, dtype=torch.int32).flatten(), device
    )


class _Shapes:
    def __init__(self, q, v, chunks, seq):
        self.R, self.H, self.K = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        self.V = v.shape[-1]
        self.NC, self.N = chunks.numel() // 2, seq.numel() // 2 - 1
        self.BK, self.BV = triton.next_power_of_2(self.K), triton.next_power_of_2(self.V)
        # V block of the sequential kernels and _output (more programs in flight; 16 and 32 measured
        # slower for bf16 on the H200); fp32 tiles take twice the shared memory
        self.BVS = min(self.BV, 64 if q.element_size() == 2 else 32)
        self.BKS = min(self.BK, 64)  # K block of _dlocal and _dintra
        self.PREC = dot_precision(q)
        self.DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)
        # what only feeds products is stored in their operands' dtype (nothing is lost: they round it anyway)
        self.low = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
        # the decay a diagonal block may span and still be a product (see _spanned): e^80 and e^-80 are
        # finite and normal in fp32 and bf16, fp16 reaches e^11 only
        self.SPAN = 8.0 if q.dtype == torch.float16 else 80.0


def _gamma_of(g, chunks, s: _Shapes) -> torch.Tensor:
    """Gamma = cumsum(g) inside each chunk, fp32 (not saved: the backward computes it again)."""
    G = g.new_empty(s.R, s.H, s.K, dtype=torch.float32)
    _cumsum[(s.NC, s.H)](g, G, chunks, s.H, s.K, BK=s.BK, REVERSE=False)
    return G


def _prepare(q, k, g, beta, scale, chunks, s: _Shapes):
    """Gamma, A_qk and (I + A_kk)^-1 (saved for the backward)."""
    R, H, K = s.R, s.H, s.K
    G = _gamma_of(g, chunks, s)
    Aqk = q.new_empty(R, H, C, dtype=s.low)
    Akk = q.new_empty(R, H, C, dtype=torch.float32)
    _intra[(s.NC * 4, H)](
        q, k, beta, G, Aqk, Akk, chunks, scale, H, K, BK=s.BK, DT=s.DT, PREC=s.PREC, SPAN=s.SPAN, num_warps=2
    )
    Mi = q.new_empty(R, H, C, dtype=s.low)
    _solve[(s.NC, H)](Akk, Mi, chunks, H, num_warps=8)
    return G, Aqk, Mi


def _recurrence(q, k, v, beta, G, Mi, h0, scale, chunks, seq, s: _Shapes):
    """W, the decayed keys and queries, the state at each chunk's start, V' = U - W S and the final state."""
    R, H, K, V = s.R, s.H, s.K, s.V
    W, KD, QG = (k.new_empty(R, H, K, dtype=s.low) for _ in range(3))
    U = k.new_empty(R, H, V, dtype=s.low)
    _wu[(s.NC, H)](
        q, k, v, beta, G, Mi, W, U, KD, QG, chunks, scale, H, K, V, BK=s.BK, BV=s.BV, DT=s.DT, PREC=s.PREC, num_warps=8
    )
    HS = k.new_empty(s.NC, H, K, V, dtype=s.low)
    VN = k.new_empty(R, H, V, dtype=s.low)
    HT = k.new_empty(s.N, H, K, V, dtype=torch.float32)
    _states[(triton.cdiv(V, s.BVS), s.N * H)](
        KD,
        W,
        U,
        G,
        h0 if h0 is not None else HT,
        HS,
        VN,
        HT,
        chunks,
        seq,
        H,
        K,
        V,
        BK=s.BK,
        BV=s.BVS,
        HAS_H0=h0 is not None,
        DT=s.DT,
        PREC=s.PREC,
        num_stages=2,
    )
    return W, KD, QG, HS, VN, HT


class _KDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, cu):
        B, T, H, K = q.shape
        chunks, seq = _chunks(cu, q.device)
        s = _Shapes(q, v, chunks, seq)
        flat = [x.contiguous() for x in (q, k, v, g, beta)]
        q, k, v, g, beta = flat
        ctx.h0_dtype = h0.dtype if h0 is not None else None
        h0 = h0.float().contiguous() if h0 is not None else None

        def run():
            G, Aqk, Mi = _prepare(q, k, g, beta, scale, chunks, s)
            _, _, QG, HS, VN, HT = _recurrence(q, k, v, beta, G, Mi, h0, scale, chunks, seq, s)
            o = torch.empty(B, T, H, s.V, device=q.device, dtype=v.dtype)
            _output[(s.NC, H, triton.cdiv(s.V, s.BVS))](
                QG, Aqk, HS, VN, o, chunks, H, K, s.V, BK=s.BK, BV=s.BVS, DT=s.DT, PREC=s.PREC
            )
            return o, HT, Aqk, Mi

        o, HT, Aqk, Mi = kept("kda", run)  # all the backward saves but the inputs
        ctx.save_for_backward(*flat, h0 if h0 is not None else HT.new_empty(0), chunks, seq, Aqk, Mi)
        ctx.scale, ctx.s, ctx.has_h0 = scale, s, h0 is not None
        return o, HT

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, chunks, seq, Aqk, Mi = ctx.saved_tensors
        s, scale = ctx.s, ctx.scale
        h0 = h0 if ctx.has_h0 else None
        R, H, K, V, NC, N = s.R, s.H, s.K, s.V, s.NC, s.N
        G = _gamma_of(g, chunks, s)
        W, KD, QG, HS, VN, _ = _recurrence(q, k, v, beta, G, Mi, h0, scale, chunks, seq, s)
        do = do.contiguous()
        f32 = torch.float32
        DH = torch.empty_like(HS, dtype=f32)
        DVN = q.new_empty(R, H, V, dtype=s.low)
        DH0 = q.new_empty(N, H, K, V, dtype=f32)
        _dstates[(triton.cdiv(V, s.BVS), N * H)](
            QG,
            KD,
            G,
            W,
            Aqk,
            do,
            dht.float().contiguous() if dht is not None else DH0,
            DH,
            DVN,
            DH0,
            chunks,
            seq,
            H,
            K,
            V,
            BK=s.BK,
            BV=s.BVS,
            HAS_DHT=dht is not None,
            DT=s.DT,
            PREC=s.PREC,
            num_stages=2,
        )
        dq, dk, dG = (q.new_empty(R, H, K, dtype=f32) for _ in range(3))
        dv = torch.empty_like(v)
        db = q.new_empty(R, H, dtype=f32)
        dAqk, dAkk = q.new_empty(R, H, C, dtype=f32), q.new_empty(R, H, C, dtype=f32)
        _dlocal[(NC, H)](
            q,
            k,
            v,
            beta,
            G,
            Mi,
            VN,
            DVN,
            do,
            HS,
            DH,
            dq,
            dk,
            dv,
            db,
            dG,
            dAqk,
            dAkk,
            chunks,
            scale,
            H,
            K,
            V,
            BK=s.BKS,
            BV=min(s.BV, 32),
            DT=s.DT,
            PREC=s.PREC,
            num_warps=8,
        )
        NKB = triton.cdiv(K, s.BKS)
        dbp = q.new_empty(NKB, R, H, dtype=f32)
        dqo, dko = torch.empty_like(q), torch.empty_like(k)
        # fp32 operands (tf32 for bf16 inputs): dGamma's terms cancel in sums over the chunk (A depends on
        # Gamma_i - Gamma_j only), bf16 products leave a residue that dg's reverse cumsum carries along
        _dintra[(NC * 4, H, NKB)](
            q,
            k,
            beta,
            G,
            dAqk,
            dAkk,
            dq,
            dk,
            dbp,
            dG,
            dqo,
            dko,
            chunks,
            scale,
            R,
            H,
            K,
            BK=s.BKS,
            DT=tl.float32,
            PREC=s.PREC,
            SPAN=s.SPAN,
            num_warps=2,
        )
        db += dbp.sum(0)
        dg = torch.empty_like(g)
        _cumsum[(NC, H)](dG, dg, chunks, H, K, BK=s.BK, REVERSE=True)
        return (
            dqo,
            dko,
            dv,
            dg,
            db.view(beta.shape).to(beta.dtype),
            None,
            DH0.to(ctx.h0_dtype) if ctx.has_h0 else None,
            None,
        )


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.kda_chunk`` in Triton (chunks of 64 whatever ``chunk_size`` says: the chunk
    size changes the order of the sums, not the result). o in v's dtype, the final state in fp32."""
    B, T, H, K = q.shape
    if cu_seqlens is None:  # each row a sequence
        cu = list(range(0, B * T + 1, T)) if T else [0] * (B + 1)
    else:
        cu = [a for a, _ in segments(T, cu_seqlens, B)] + [T]  # checked as the reference checks them
    scale = K**-0.5 if scale is None else scale
    return _KDA.apply(q, k, v, g, beta, scale, initial_state, cu)
