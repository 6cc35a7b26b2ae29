"""KDA's Triton kernels: the tile helpers the forward (chunk_fwd.py) and backward (chunk_bwd.py)
kernels share (``C`` rows a chunk, tiles of a head's rows and channels, the chunk tables, the
state pointers of the chunk-by-chunk programs). Legend and precision as in triton.py."""

from __future__ import annotations

import triton
import triton.language as tl

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
def _operand_v(P, rows, ok, h, H, D, d0, BD: tl.constexpr):
    """[rows, columns d0..d0+BD) of head h from a [R, H, D] tensor, in P's own dtype (a tile that
    only enters products: ``_dot`` takes it as it is); zeros outside."""
    d = d0 + tl.arange(0, BD)
    return tl.load(
        P + (rows[:, None].to(tl.int64) * H + h) * D + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0
    )


@triton.jit
def _tile_v(P, rows, ok, h, H, D, d0, BD: tl.constexpr):
    """``_operand_v`` in fp32."""
    return _operand_v(P, rows, ok, h, H, D, d0, BD).to(tl.float32)


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
    """A chunk's [64, 64] lower triangle with the diagonal, zeros above, fp32. (Loaded in P's own
    dtype by a triangular mask instead, the H200 hit an illegal address in ``_dstates`` at V
    blocks of 32 and 16, Triton 3.6, 2026-12-05; the interpreter and ptxas saw nothing.)"""
    i = tl.arange(0, 64)
    return tl.where(i[None, :] <= i[:, None], _square(P, rows, ok, h, H, 0, 64), 0.0)


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
def _block_row(P, row, end, h, H, col0, r, i16):
    """Of a [R, H, 64] chunk matrix's row ``row``, the 16 columns from col0 left of the diagonal
    block's step r (j < r), fp32; zeros past the chunk's rows."""
    return tl.load(P + (row.to(tl.int64) * H + h) * 64 + col0 + i16, mask=(i16 < r) & (row < end), other=0.0).to(
        tl.float32
    )


@triton.jit
def _unit_inverse_row(D, a_r, r, i16):
    """Forward substitution's step r on a 16 x 16 unit lower-triangular inverse: row r of D becomes
    e_r - sum_{j < r} a_rj D_j (rows j < r are final; a_r is row r of A, zero from r on)."""
    return tl.where(i16[:, None] == r, D - tl.sum(a_r[:, None] * D, 0)[None, :], D)


@triton.jit
def _mm(a, b):
    """fp32 products for the inverse (fla's tril solve keeps IEEE fp32 too)."""
    return tl.dot(a, b, input_precision="ieee")


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
def _state_tiles(HS, DH, c, h, H, K, VD, d0, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Rows d0..d0+BK, columns v0..v0+BV of chunk c's state and its gradient, fp32."""
    p, m = _state_ptrs(HS, c, h, H, K, VD, d0, v0, BK, BV)
    pd, _ = _state_ptrs(DH, c, h, H, K, VD, d0, v0, BK, BV)
    return tl.load(p, mask=m, other=0.0).to(tl.float32), tl.load(pd, mask=m, other=0.0).to(tl.float32)
