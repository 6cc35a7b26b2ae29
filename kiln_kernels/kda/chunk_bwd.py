"""KDA's backward kernels (the plan is in triton.py's docstring): ``_dstates`` (the chunks in
reverse: dS, dV'), ``_dlocal`` (the gradients through S, dS, V' and the inverse), ``_dintra`` (the
gradients through A_qk and A_kk)."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln_kernels.kda.tiles import (
    _beta,
    _block,
    _chunk_of,
    _column,
    _dot,
    _earlier_keys,
    _gamma,
    _lower,
    _mm,
    _put_square,
    _put_v,
    _row,
    _rows,
    _spanned,
    _square,
    _state_ptrs,
    _state_tiles,
    _tile,
    _tile_v,
    _walk,
)


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
