"""KDA's chunked form in Triton, forward and backward; the signature of ``reference.kda_chunk``.

Sequences (``cu_seqlens``, or the batch's rows) are cut into chunks of C = 64 tokens that never
straddle two sequences. Per (chunk, head), with Gamma = cumsum(g) inside the chunk:

- forward: ``_cumsum`` (Gamma), ``_intra`` (A_qk, A_kk), ``_solve`` ((I + A_kk)^-1 by blocks,
  then W and U), ``_states`` (the chunks in order per sequence and head: the state
  at each chunk's start, V' = U - W S), ``_output`` (O = (Q e^Gamma) S + A_qk V');
- backward: the forward again up to ``_states`` (nothing but the inputs is saved), ``_dstates``
  (the chunks in reverse: dS at each chunk's end, dV'), ``_dlocal`` (every gradient that needs
  S, dS, V' or (I + A_kk)^-1, and dA_qk, dA_kk), ``_dintra`` (the gradients through A_qk and
  A_kk), then ``_cumsum`` reversed turns dGamma into dg.

A_qk[i, j] = sum_d q_id k_jd e^(Gamma_id - Gamma_jd) (j <= i) has a decay per channel, so it is no
plain product. In blocks of 16 rows it is: for a row block X and an earlier block J, with r the
first row of X, (q_X e^(Gamma_X - Gamma_r)) (k_J e^(Gamma_r - Gamma_J))^T, both factors <= 1 as
g <= 0 (a product on the tensor cores, no overflow whatever the decay); inside X, a loop over its
16 columns. A_kk is the same with beta_i k_i for q_i and j < i.

Legend as in reference.py; R = B * T rows. Intermediates are stored in fp32; the products take
their operands in the inputs' dtype (bf16 tensor cores for bf16 inputs, IEEE fp32 for fp32) and
sum in fp32; the inverse's products are IEEE fp32 always.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import dot_precision
from kernels.kda.reference import segments

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
    return tl.load(P + (rows[:, None].to(tl.int64) * H + h) * D + d[None, :], mask=ok[:, None] & (d[None, :] < D),
                   other=0.0).to(tl.float32)


@triton.jit
def _put_v(P, x, rows, ok, h, H, D, d0, BD: tl.constexpr):
    d = d0 + tl.arange(0, BD)
    tl.store(P + (rows[:, None].to(tl.int64) * H + h) * D + d[None, :], x.to(P.dtype.element_ty),
             mask=ok[:, None] & (d[None, :] < D))


@triton.jit
def _tile(P, rows, ok, h, H, D, BD: tl.constexpr):
    """All of a row's D columns (BD >= D)."""
    return _tile_v(P, rows, ok, h, H, D, 0, BD)


@triton.jit
def _put(P, x, rows, ok, h, H, D, BD: tl.constexpr):
    _put_v(P, x, rows, ok, h, H, D, 0, BD)


@triton.jit
def _row(P, row, h, H, D, BD: tl.constexpr):
    d = tl.arange(0, BD)
    return tl.load(P + (row.to(tl.int64) * H + h) * D + d, mask=d < D, other=0.0).to(tl.float32)


@triton.jit
def _gamma(G, rows, ok, last, h, H, K, BK: tl.constexpr):
    """Gamma on rows; rows past the sequence take the last row's (finite differences, no overflow)."""
    x = _tile(G, rows, ok, h, H, K, BK)
    return tl.where(ok[:, None], x, _row(G, last, h, H, K, BK)[None, :])


@triton.jit
def _square(P, rows, ok, h, H, cols0, NC: tl.constexpr):
    """[rows, NC] of head h from a [R, H, 64] fp32 matrix of chunk rows, columns cols0..cols0+NC."""
    c = cols0 + tl.arange(0, NC)
    return tl.load(P + (rows[:, None].to(tl.int64) * H + h) * 64 + c[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _put_square(P, x, rows, ok, h, H, cols0, NC: tl.constexpr):
    c = cols0 + tl.arange(0, NC)
    tl.store(P + (rows[:, None].to(tl.int64) * H + h) * 64 + c[None, :], x, mask=ok[:, None])


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
def _block(Q, Kt, BETA, G, row0, last, h, H, scale, K, BK: tl.constexpr):
    """Row block [row0, row0 + 16) of a chunk: its rows and which are in the sequence, Gamma, Gamma
    at its first row (the reference of the factored products), q (scaled), k and beta."""
    rows = row0 + tl.arange(0, 16)
    ok = rows <= last
    g = _gamma(G, rows, ok, last, h, H, K, BK)
    g_r = _row(G, tl.minimum(row0, last), h, H, K, BK)
    q = _tile(Q, rows, ok, h, H, K, BK) * scale
    return rows, ok, g, g_r, q, _tile(Kt, rows, ok, h, H, K, BK), _beta(BETA, rows, ok, h, H)


@triton.jit
def _earlier_keys(Kt, G, row0, last, g_r, h, H, K, BK: tl.constexpr):
    """k_J e^(Gamma_r - Gamma_J) on the row block [row0, row0 + 16) before the reference row r:
    the earlier block's factor of the split products (<= 1)."""
    rows = row0 + tl.arange(0, 16)
    ok = rows <= last
    return _tile(Kt, rows, ok, h, H, K, BK) * tl.exp(g_r[None, :] - _gamma(G, rows, ok, last, h, H, K, BK))


@triton.jit
def _intra(Q, Kt, BETA, G, AQK, AKK, CHUNKS, scale, H, K, BK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """A_qk (j <= i) and A_kk (beta_i, j < i) of one chunk and head, by row blocks of 16."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, _, _, last = _rows(CHUNKS, c)
    i16 = tl.arange(0, 16)
    for X in tl.static_range(4):
        rX, okX, gX, g_r, qX, kX, bX = _block(Q, Kt, BETA, G, bos + X * 16, last, h, H, scale, K, BK)
        dX = tl.exp(gX - g_r[None, :])
        aq = qX * dX
        ak = kX * dX
        for J in tl.static_range(X):
            kJ = _earlier_keys(Kt, G, bos + J * 16, last, g_r, h, H, K, BK)
            _put_square(AQK, _dot(aq, tl.trans(kJ), DT, PREC), rX, okX, h, H, J * 16, 16)
            _put_square(AKK, _dot(ak, tl.trans(kJ), DT, PREC) * bX[:, None], rX, okX, h, H, J * 16, 16)
        aqd = tl.zeros([16, 16], tl.float32)
        akd = tl.zeros([16, 16], tl.float32)
        for j in range(16):
            rj = tl.minimum(bos + X * 16 + j, last)
            kj = tl.where(bos + X * 16 + j <= last, _row(Kt, rj, h, H, K, BK), 0.0)
            e = tl.exp(tl.where(i16[:, None] >= j, gX - _row(G, rj, h, H, K, BK)[None, :], float("-inf")))
            colq = tl.sum(qX * kj[None, :] * e, 1)
            colk = tl.sum(kX * kj[None, :] * tl.where(i16[:, None] > j, e, 0.0), 1)
            aqd = tl.where(i16[None, :] == j, colq[:, None], aqd)
            akd = tl.where(i16[None, :] == j, colk[:, None], akd)
        _put_square(AQK, aqd, rX, okX, h, H, X * 16, 16)
        _put_square(AKK, akd * bX[:, None], rX, okX, h, H, X * 16, 16)


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
def _solve(AKK, Kt, V, BETA, G, W, U, CHUNKS, H, K, VD, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
           PREC: tl.constexpr):
    """Mi = (I + A_kk)^-1, written over A_kk, by blocks of 16: the four diagonal blocks D_X by
    forward substitution (side by side), then Mi_XJ = -D_X sum_{J <= L < X} A_XL Mi_LJ.
    W = Mi (beta e^Gamma k), U = Mi (beta v)."""
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
    A30, A31, A32 = (_square(AKK, r3, k3, h, H, 0, 16), _square(AKK, r3, k3, h, H, 16, 16),
                     _square(AKK, r3, k3, h, H, 32, 16))
    M10 = -_mm(D1, _mm(A10, D0))
    M21 = -_mm(D2, _mm(A21, D1))
    M32 = -_mm(D3, _mm(A32, D2))
    M20 = -_mm(D2, _mm(A20, D0) + _mm(A21, M10))
    M31 = -_mm(D3, _mm(A31, D1) + _mm(A32, M21))
    M30 = -_mm(D3, _mm(A30, D0) + _mm(A31, M10) + _mm(A32, M20))
    _put_square(AKK, D0, r0, k0, h, H, 0, 16)
    _put_square(AKK, M10, r1, k1, h, H, 0, 16)
    _put_square(AKK, D1, r1, k1, h, H, 16, 16)
    _put_square(AKK, M20, r2, k2, h, H, 0, 16)
    _put_square(AKK, M21, r2, k2, h, H, 16, 16)
    _put_square(AKK, D2, r2, k2, h, H, 32, 16)
    _put_square(AKK, M30, r3, k3, h, H, 0, 16)
    _put_square(AKK, M31, r3, k3, h, H, 16, 16)
    _put_square(AKK, M32, r3, k3, h, H, 32, 16)
    _put_square(AKK, D3, r3, k3, h, H, 48, 16)
    # W and U, row block by row block
    kb0, vb0 = _weighted(Kt, V, BETA, G, r0, k0, last, h, H, K, VD, BK, BV)
    kb1, vb1 = _weighted(Kt, V, BETA, G, r1, k1, last, h, H, K, VD, BK, BV)
    kb2, vb2 = _weighted(Kt, V, BETA, G, r2, k2, last, h, H, K, VD, BK, BV)
    kb3, vb3 = _weighted(Kt, V, BETA, G, r3, k3, last, h, H, K, VD, BK, BV)
    _put(W, _dot(D0, kb0, DT, PREC), r0, k0, h, H, K, BK)
    _put(U, _dot(D0, vb0, DT, PREC), r0, k0, h, H, VD, BV)
    _put(W, _dot(M10, kb0, DT, PREC) + _dot(D1, kb1, DT, PREC), r1, k1, h, H, K, BK)
    _put(U, _dot(M10, vb0, DT, PREC) + _dot(D1, vb1, DT, PREC), r1, k1, h, H, VD, BV)
    _put(W, _dot(M20, kb0, DT, PREC) + _dot(M21, kb1, DT, PREC) + _dot(D2, kb2, DT, PREC), r2, k2, h, H, K, BK)
    _put(U, _dot(M20, vb0, DT, PREC) + _dot(M21, vb1, DT, PREC) + _dot(D2, vb2, DT, PREC), r2, k2, h, H, VD, BV)
    _put(W, _dot(M30, kb0, DT, PREC) + _dot(M31, kb1, DT, PREC) + _dot(M32, kb2, DT, PREC) + _dot(D3, kb3, DT, PREC),
         r3, k3, h, H, K, BK)
    _put(U, _dot(M30, vb0, DT, PREC) + _dot(M31, vb1, DT, PREC) + _dot(M32, vb2, DT, PREC) + _dot(D3, vb3, DT, PREC),
         r3, k3, h, H, VD, BV)


@triton.jit
def _weighted(Kt, V, BETA, G, rows, ok, last, h, H, K, VD, BK: tl.constexpr, BV: tl.constexpr):
    """beta e^Gamma k and beta v on rows."""
    b = _beta(BETA, rows, ok, h, H)
    kb = _tile(Kt, rows, ok, h, H, K, BK) * tl.exp(_gamma(G, rows, ok, last, h, H, K, BK)) * b[:, None]
    return kb, _tile(V, rows, ok, h, H, VD, BV) * b[:, None]


@triton.jit
def _state_ptrs(P, n, h, H, K, VD, v0, BK: tl.constexpr, BV: tl.constexpr):
    """A [BK, BV] block of state n, head h, from [N, H, K, V], and its mask."""
    d = tl.arange(0, BK)
    e = v0 + tl.arange(0, BV)
    return P + ((n * H + h).to(tl.int64) * K + d[:, None]) * VD + e[None, :], (d[:, None] < K) & (e[None, :] < VD)


@triton.jit
def _states(Kt, W, U, G, H0, HS, VN, HT, CHUNKS, SEQ, H, K, VD, BK: tl.constexpr, BV: tl.constexpr,
            HAS_H0: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Per sequence, head and block of V, the chunks in order: HS[c] = the state at chunk c's
    start, VN = U - W S; the final state into HT."""
    vb, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    v0 = vb * BV
    p0, m0 = _state_ptrs(H0, n, h, H, K, VD, v0, BK, BV)
    S = tl.load(p0, mask=m0 & HAS_H0, other=0.0).to(tl.float32)
    c0, c1 = tl.load(SEQ + n), tl.load(SEQ + n + 1)
    for c in range(c0, c1):
        p, m = _state_ptrs(HS, c, h, H, K, VD, v0, BK, BV)
        tl.store(p, S, mask=m)
        bos, rows, ok, last = _rows(CHUNKS, c)
        vn = _tile_v(U, rows, ok, h, H, VD, v0, BV) - _dot(_tile(W, rows, ok, h, H, K, BK), S, DT, PREC)
        _put_v(VN, vn, rows, ok, h, H, VD, v0, BV)
        gm = _gamma(G, rows, ok, last, h, H, K, BK)
        g_last = _row(G, last, h, H, K, BK)
        kd = _tile(Kt, rows, ok, h, H, K, BK) * tl.exp(g_last[None, :] - gm)
        S = S * tl.exp(g_last)[:, None] + _dot(tl.trans(kd), vn, DT, PREC)
    p, m = _state_ptrs(HT, n, h, H, K, VD, v0, BK, BV)
    tl.store(p, S, mask=m)


@triton.jit
def _output(Q, G, AQK, HS, VN, O, CHUNKS, scale, H, K, VD, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """O = (q e^Gamma) S + A_qk V' for one chunk, head and block of V."""
    c, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    v0 = vb * BV
    bos, rows, ok, last = _rows(CHUNKS, c)
    i = tl.arange(0, 64)
    qg = _tile(Q, rows, ok, h, H, K, BK) * scale * tl.exp(_gamma(G, rows, ok, last, h, H, K, BK))
    p, m = _state_ptrs(HS, c, h, H, K, VD, v0, BK, BV)
    A = tl.where(i[None, :] <= i[:, None], _square(AQK, rows, ok, h, H, 0, 64), 0.0)
    o = _dot(qg, tl.load(p, mask=m, other=0.0), DT, PREC)
    o += _dot(A, _tile_v(VN, rows, ok, h, H, VD, v0, BV), DT, PREC)
    _put_v(O, o, rows, ok, h, H, VD, v0, BV)


@triton.jit
def _dstates(Q, Kt, G, W, AQK, DO, DHT, DH, DVN, DH0, CHUNKS, SEQ, scale, H, K, VD, BK: tl.constexpr,
             BV: tl.constexpr, HAS_DHT: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The chunks in reverse: DH[c] = dS at chunk c's end; dV' = A_qk^T dO + (k e^(Gamma_C - Gamma)) dS;
    dS at the chunk's start = (q e^Gamma)^T dO + e^Gamma_C dS - W^T dV'. The first into DH0."""
    vb, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    v0 = vb * BV
    i = tl.arange(0, 64)
    p0, m0 = _state_ptrs(DHT, n, h, H, K, VD, v0, BK, BV)
    dS = tl.load(p0, mask=m0 & HAS_DHT, other=0.0).to(tl.float32)
    c0, c1 = tl.load(SEQ + n), tl.load(SEQ + n + 1)
    for cc in range(c0, c1):
        c = c1 - 1 - (cc - c0)
        p, m = _state_ptrs(DH, c, h, H, K, VD, v0, BK, BV)
        tl.store(p, dS, mask=m)
        bos, rows, ok, last = _rows(CHUNKS, c)
        gm = _gamma(G, rows, ok, last, h, H, K, BK)
        g_last = _row(G, last, h, H, K, BK)
        k = _tile(Kt, rows, ok, h, H, K, BK)
        do = _tile_v(DO, rows, ok, h, H, VD, v0, BV)
        A = tl.where(i[None, :] <= i[:, None], _square(AQK, rows, ok, h, H, 0, 64), 0.0)
        dvn = _dot(tl.trans(A), do, DT, PREC)
        dvn += _dot(k * tl.exp(g_last[None, :] - gm), dS, DT, PREC)
        _put_v(DVN, dvn, rows, ok, h, H, VD, v0, BV)
        qg = _tile(Q, rows, ok, h, H, K, BK) * scale * tl.exp(gm)
        dS = dS * tl.exp(g_last)[:, None] + _dot(tl.trans(qg), do, DT, PREC)
        dS -= _dot(tl.trans(_tile(W, rows, ok, h, H, K, BK)), dvn, DT, PREC)
    p, m = _state_ptrs(DH0, n, h, H, K, VD, v0, BK, BV)
    tl.store(p, dS, mask=m)


@triton.jit
def _dlocal(Q, Kt, V, BETA, G, MI, VN, DVN, DO, HS, DH, DQ, DK, DV, DB, DG, DAQK, DAKK, CHUNKS, scale,
            H, K, VD, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Per chunk and head, the gradients through everything but A_qk and A_kk (whose gradients
    it writes): q (through q e^Gamma S), k (through the state update and W), v and beta (through
    W and U), Gamma; dq is of the scaled q. V in blocks of BV, the sums over V accumulated."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, rows, ok, last = _rows(CHUNKS, c)
    i = tl.arange(0, 64)
    gm = _gamma(G, rows, ok, last, h, H, K, BK)
    g_last = _row(G, last, h, H, K, BK)
    eg = tl.exp(gm)
    q = _tile(Q, rows, ok, h, H, K, BK) * scale
    k = _tile(Kt, rows, ok, h, H, K, BK)
    b = _beta(BETA, rows, ok, h, H)
    Mi = tl.where(i[None, :] <= i[:, None], _square(MI, rows, ok, h, H, 0, 64), 0.0)
    dAqk = tl.zeros([64, 64], tl.float32)
    dMi = tl.zeros([64, 64], tl.float32)
    dqg = tl.zeros([64, BK], tl.float32)
    dkd = tl.zeros([64, BK], tl.float32)
    dW = tl.zeros([64, BK], tl.float32)
    SdS = tl.zeros([BK], tl.float32)
    db = tl.zeros([64], tl.float32)
    for v0 in range(0, VD, BV):
        vn = _tile_v(VN, rows, ok, h, H, VD, v0, BV)
        dvn = _tile_v(DVN, rows, ok, h, H, VD, v0, BV)
        do = _tile_v(DO, rows, ok, h, H, VD, v0, BV)
        v = _tile_v(V, rows, ok, h, H, VD, v0, BV)
        ps, ms = _state_ptrs(HS, c, h, H, K, VD, v0, BK, BV)
        S = tl.load(ps, mask=ms, other=0.0)
        pd, md = _state_ptrs(DH, c, h, H, K, VD, v0, BK, BV)
        dS = tl.load(pd, mask=md, other=0.0)
        dAqk += _dot(do, tl.trans(vn), DT, PREC)  # O = (q e^Gamma) S + A_qk V'
        dqg += _dot(do, tl.trans(S), DT, PREC)
        dkd += _dot(vn, tl.trans(dS), DT, PREC)  # S' = e^Gamma_C S + (k e^(Gamma_C - Gamma))^T V'
        SdS += tl.sum(S * dS, 1)
        dW -= _dot(dvn, tl.trans(S), DT, PREC)  # V' = U - W S, U = Mi (beta v)
        dvb = _dot(tl.trans(Mi), dvn, DT, PREC)
        _put_v(DV, dvb * b[:, None], rows, ok, h, H, VD, v0, BV)
        db += tl.sum(v * dvb, 1)
        dMi += _dot(dvn, tl.trans(v * b[:, None]), DT, PREC)
    _put_square(DAQK, tl.where(i[None, :] <= i[:, None], dAqk, 0.0), rows, ok, h, H, 0, 64)
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
    # Mi = (I + A_kk)^-1: dA_kk = -Mi^T dMi Mi^T below the diagonal
    dMi += _dot(dW, tl.trans(kb), DT, PREC)
    dA = -_dot(_dot(tl.trans(Mi), dMi, DT, PREC), tl.trans(Mi), DT, PREC)
    _put_square(DAKK, tl.where(i[None, :] < i[:, None], dA, 0.0), rows, ok, h, H, 0, 64)
    _put(DQ, dq, rows, ok, h, H, K, BK)
    _put(DK, dk, rows, ok, h, H, K, BK)
    _put(DG, dG, rows, ok, h, H, K, BK)
    tl.store(DB + rows.to(tl.int64) * H + h, db, mask=ok)


@triton.jit
def _dintra(Q, Kt, BETA, G, DAQK, DAKK, DQ, DK, DB, DG, CHUNKS, scale, H, K, BK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The gradients through A_qk = A(q, k) and A_kk = beta A(k, k), added to ``_dlocal``'s, by row
    blocks of 16 as in ``_intra``: for A(a, b) with dA, da_i = sum_j dA_ij b_j e^(Gamma_i - Gamma_j),
    db_j = sum_i dA_ij a_i e^(Gamma_i - Gamma_j), dGamma_i += a_i da_i, dGamma_j -= b_j db_j. dq
    and dk leave here final (dq times the scale)."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, _, _, last = _rows(CHUNKS, c)
    i16 = tl.arange(0, 16)
    for X in tl.static_range(4):
        rX, okX, gX, g_r, qX, kX, bX = _block(Q, Kt, BETA, G, bos + X * 16, last, h, H, scale, K, BK)
        # a-side, from the earlier blocks J: da_X = e^(Gamma_X - Gamma_r) (dA_XJ (b_J e^(Gamma_r - Gamma_J)))
        daq = tl.zeros([16, BK], tl.float32)
        dak = tl.zeros([16, BK], tl.float32)
        for J in tl.static_range(X):
            kJ = _earlier_keys(Kt, G, bos + J * 16, last, g_r, h, H, K, BK)
            daq += _dot(_square(DAQK, rX, okX, h, H, J * 16, 16), kJ, DT, PREC)
            dak += _dot(_square(DAKK, rX, okX, h, H, J * 16, 16), kJ, DT, PREC)
        dX = tl.exp(gX - g_r[None, :])
        daq *= dX
        dak *= dX
        # b-side, from the later blocks I: db_X = e^(Gamma_rI - Gamma_X) (dA_IX^T (a_I e^(Gamma_I - Gamma_rI)))
        dbq = tl.zeros([16, BK], tl.float32)
        dbk = tl.zeros([16, BK], tl.float32)
        for I in tl.static_range(X + 1, 4):
            rI, okI, gI, g_rI, qI, kI, bI = _block(Q, Kt, BETA, G, bos + I * 16, last, h, H, scale, K, BK)
            dI = tl.exp(gI - g_rI[None, :])
            eX = tl.exp(g_rI[None, :] - gX)
            dbq += eX * _dot(tl.trans(_square(DAQK, rI, okI, h, H, X * 16, 16)), qI * dI, DT, PREC)
            dbk += eX * _dot(tl.trans(_square(DAKK, rI, okI, h, H, X * 16, 16)), kI * bI[:, None] * dI, DT, PREC)
        # inside X, column by column
        dAq = _square(DAQK, rX, okX, h, H, X * 16, 16)
        dAk = _square(DAKK, rX, okX, h, H, X * 16, 16)
        for j in range(16):
            rj = tl.minimum(bos + X * 16 + j, last)
            kj = tl.where(bos + X * 16 + j <= last, _row(Kt, rj, h, H, K, BK), 0.0)
            e = tl.exp(tl.where(i16[:, None] >= j, gX - _row(G, rj, h, H, K, BK)[None, :], float("-inf")))
            es = tl.where(i16[:, None] > j, e, 0.0)
            cq = tl.sum(tl.where(i16[None, :] == j, dAq, 0.0), 1)
            ck = tl.sum(tl.where(i16[None, :] == j, dAk, 0.0), 1)
            daq += cq[:, None] * kj[None, :] * e
            dak += ck[:, None] * kj[None, :] * es
            dbq = tl.where(i16[:, None] == j, dbq + tl.sum(cq[:, None] * qX * e, 0)[None, :], dbq)
            dbk = tl.where(i16[:, None] == j, dbk + tl.sum(ck[:, None] * kX * bX[:, None] * es, 0)[None, :], dbk)
        dG = _tile(DG, rX, okX, h, H, K, BK) + qX * daq + kX * bX[:, None] * dak - kX * (dbq + dbk)
        _put(DG, dG, rX, okX, h, H, K, BK)
        _put(DQ, (_tile(DQ, rX, okX, h, H, K, BK) + daq) * scale, rX, okX, h, H, K, BK)
        _put(DK, _tile(DK, rX, okX, h, H, K, BK) + bX[:, None] * dak + dbq + dbk, rX, okX, h, H, K, BK)
        db = tl.load(DB + rX.to(tl.int64) * H + h, mask=okX, other=0.0) + tl.sum(kX * dak, 1)
        tl.store(DB + rX.to(tl.int64) * H + h, db, mask=okX)


def _chunks(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's [first row, end) and each sequence's first chunk (and the total last)."""
    spans, seq = [], [0]
    for a, b in zip(cu, cu[1:]):
        spans += [(s, min(s + C, b)) for s in range(a, b, C)]
        seq.append(len(spans))
    t = torch.tensor(spans or [(0, 0)], dtype=torch.int32).flatten()
    return t.to(device), torch.tensor(seq, dtype=torch.int32).to(device)


class _Shapes:
    def __init__(self, q, v):
        self.R, self.H, self.K = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        self.V = v.shape[-1]
        self.BK, self.BV = triton.next_power_of_2(self.K), triton.next_power_of_2(self.V)
        # V block of the sequential kernels (more programs in flight) and of _dlocal; fp32 tiles take
        # twice the shared memory
        self.BVS = min(self.BV, 64 if q.element_size() == 2 else 32)
        self.PREC = dot_precision(q)
        self.DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)


def _forward(q, k, v, g, beta, scale, h0, chunks, seq, s: _Shapes):
    """Everything before the output: Gamma, A_qk, (I + A_kk)^-1, W, the chunk states, V', the
    final state (U only in passing)."""
    dev, f32 = q.device, torch.float32
    NC, N = chunks.numel() // 2, seq.numel() - 1
    R, H, K, V = s.R, s.H, s.K, s.V
    G = torch.empty(R, H, K, device=dev, dtype=f32)
    _cumsum[(NC, H)](g, G, chunks, H, K, BK=s.BK, REVERSE=False)
    Aqk = torch.empty(R, H, C, device=dev, dtype=f32)
    Mi = torch.empty(R, H, C, device=dev, dtype=f32)
    _intra[(NC, H)](q, k, beta, G, Aqk, Mi, chunks, scale, H, K, BK=s.BK, DT=s.DT, PREC=s.PREC)
    W = torch.empty(R, H, K, device=dev, dtype=f32)
    U = torch.empty(R, H, V, device=dev, dtype=f32)
    _solve[(NC, H)](Mi, k, v, beta, G, W, U, chunks, H, K, V, BK=s.BK, BV=s.BV, DT=s.DT, PREC=s.PREC, num_warps=8)
    HS = torch.empty(NC, H, K, V, device=dev, dtype=f32)
    VN = torch.empty(R, H, V, device=dev, dtype=f32)
    HT = torch.empty(N, H, K, V, device=dev, dtype=f32)
    _states[(triton.cdiv(V, s.BVS), N * H)](k, W, U, G, h0 if h0 is not None else HT, HS, VN, HT, chunks, seq,
                                            H, K, V, BK=s.BK, BV=s.BVS, HAS_H0=h0 is not None, DT=s.DT, PREC=s.PREC,
                                            num_stages=2)
    return G, Aqk, Mi, W, HS, VN, HT


class _KDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, cu):
        B, T, H, K = q.shape
        s = _Shapes(q, v)
        chunks, seq = _chunks(cu, q.device)
        flat = [x.contiguous() for x in (q, k, v, g, beta)]
        ctx.h0_dtype = h0.dtype if h0 is not None else None
        h0 = h0.float().contiguous() if h0 is not None else None
        G, Aqk, _, _, HS, VN, HT = _forward(*flat, scale, h0, chunks, seq, s)
        o = torch.empty(B, T, H, s.V, device=q.device, dtype=torch.float32)
        NC = chunks.numel() // 2
        _output[(NC, H, triton.cdiv(s.V, s.BVS))](flat[0], G, Aqk, HS, VN, o, chunks, scale, H, K, s.V, BK=s.BK,
                                                  BV=s.BVS, DT=s.DT, PREC=s.PREC)
        ctx.save_for_backward(*flat, h0 if h0 is not None else HT.new_empty(0), chunks, seq)
        ctx.scale, ctx.s, ctx.has_h0 = scale, s, h0 is not None
        return o, HT

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, chunks, seq = ctx.saved_tensors
        s, scale = ctx.s, ctx.scale
        h0 = h0 if ctx.has_h0 else None
        R, H, K, V = s.R, s.H, s.K, s.V
        NC, N = chunks.numel() // 2, seq.numel() - 1
        G, Aqk, Mi, W, HS, VN, _ = _forward(q, k, v, g, beta, scale, h0, chunks, seq, s)
        do = do.float().contiguous()
        dev, f32 = q.device, torch.float32
        DH = torch.empty_like(HS)
        DVN = torch.empty(R, H, V, device=dev, dtype=f32)
        DH0 = torch.empty(N, H, K, V, device=dev, dtype=f32)
        _dstates[(triton.cdiv(V, s.BVS), N * H)](q, k, G, W, Aqk, do, dht.float().contiguous() if dht is not None
                                                 else DH0, DH, DVN, DH0, chunks, seq, scale, H, K, V, BK=s.BK,
                                                 BV=s.BVS, HAS_DHT=dht is not None, DT=s.DT, PREC=s.PREC,
                                                 num_stages=2)
        dq, dk, dG = (torch.empty(R, H, K, device=dev, dtype=f32) for _ in range(3))
        dv = torch.empty(R, H, V, device=dev, dtype=f32)
        db = torch.empty(R, H, device=dev, dtype=f32)
        dAqk, dAkk = W.new_empty(R, H, C), W.new_empty(R, H, C)
        _dlocal[(NC, H)](q, k, v, beta, G, Mi, VN, DVN, do, HS, DH, dq, dk, dv, db, dG, dAqk, dAkk, chunks, scale,
                         H, K, V, BK=s.BK, BV=min(s.BV, 32), DT=s.DT, PREC=s.PREC, num_warps=8)
        _dintra[(NC, H)](q, k, beta, G, dAqk, dAkk, dq, dk, db, dG, chunks, scale, H, K, BK=s.BK, DT=s.DT, PREC=s.PREC)
        dg = torch.empty_like(dG)
        _cumsum[(NC, H)](dG, dg, chunks, H, K, BK=s.BK, REVERSE=True)
        shape = q.shape
        return (dq.view(shape).to(q.dtype), dk.view(shape).to(k.dtype), dv.view(v.shape).to(v.dtype),
                dg.view(shape).to(g.dtype), db.view(beta.shape).to(beta.dtype), None,
                DH0.to(ctx.h0_dtype) if ctx.has_h0 else None, None)


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.kda_chunk`` in Triton (chunks of 64 whatever ``chunk_size`` says: the chunk
    size changes the order of the sums, not the result). o and the final state in fp32."""
    B, T, H, K = q.shape
    if cu_seqlens is None:  # each row a sequence
        cu = list(range(0, B * T + 1, T)) if T else [0] * (B + 1)
    else:
        cu = [a for a, _ in segments(T, cu_seqlens, B)] + [T]  # checked as the reference checks them
    scale = K ** -0.5 if scale is None else scale
    return _KDA.apply(q, k, v, g, beta, scale, initial_state, cu)
