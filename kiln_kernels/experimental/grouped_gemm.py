"""The Triton grouped GEMM of the MoE experts: rows of group e times W_e^T ([M, K] x [E, N, K] ->
[M, N]), with its backward: dx by the same kernel on W_e (strides swapped, no transposed copy) and
dW_e = dy_e^T x_e by a kernel whose reduction runs over the group's rows. Tiles never straddle two
groups; the tile -> group table is built on the device from the offsets (no host sync), for at
most cdiv(M, BM) + E tiles, the unused ones exiting at once. In a group of at least BM rows every
tile lies inside the group (its last tile overlaps the one before), so the TMA kernel stores whole
tiles without masks; smaller groups' tiles go through masked stores.

Same signatures as ``kiln_kernels.moe.grouped`` (``gmm``, torch._grouped_mm: what the engine runs)
and ``kiln_kernels.moe.reference`` (``grouped_mlp``). Not used by the engine: with both expert
weights trained it matches torch's, but its rows GEMMs, all that LoRA training runs (frozen
experts), do not. Measured: see bench/RESULTS.md, "MoE grouped GEMM at torch's speed" (thirteenth
session) and the MoE sections before it; ``python3 -m bench.moe`` times it beside torch's.
Tests: tests/gpu/test_grouped_gemm.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kiln_kernels.dispatch import dot_precision, sms
from kiln_kernels.moe.grouped import mlp
from kiln_kernels.moe.reference import Lora

# the best of bench.moe --tune: "rows" for y = x W_e^T and dx = dy W_e (persistent, TMA loads,
# the tile and reduction loops pipelined as one, whole tiles stored by TMA in two halves; where
# TMA cannot take the shapes, the pointer kernel with GROUP 8), "weights" for dW_e (persistent, TMA
# loads, warp-specialised)
CONFIG = {
    "rows": dict(BM=128, BN=256, BK=64, GROUP=8, TMA=True, FLAT=1, STORE=2, num_warps=8, num_stages=3),
    "weights": dict(BM=64, BN=256, BK=128, TMA=True, WS=1, num_warps=4, num_stages=4),
}


def _config(x: torch.Tensor, which: str) -> dict:
    """CONFIG[which], with smaller tiles for fp32 inputs (twice the shared memory per tile)."""
    cfg = dict(CONFIG[which])
    if x.element_size() == 4:
        cfg.update(BN=min(cfg["BN"], 128), BK=min(cfg["BK"], 64), num_stages=2)
    return cfg


@triton.jit
def _gmm_rows(
    X,
    W,
    Y,
    TILE_E,
    TILE_ROW,
    OFFS,
    C,
    R,
    swe,
    swc,
    swr,
    TILES_M,
    TILES_N,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """Y[m, c] = sum_r X[m, r] W[e, c, r] for the rows m of one tile of group e.

    One program id over (row tile, column tile), GROUP row tiles at a time across all column
    tiles: the rows of those tiles stay in L2 while every column tile reads them."""
    pid = tl.program_id(0)
    per_group = GROUP * TILES_N
    first = (pid // per_group) * GROUP
    size = tl.minimum(TILES_M - first, GROUP)
    pid_m = first + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    e = tl.load(TILE_E + pid_m)
    if e >= 0:
        row0 = tl.load(TILE_ROW + pid_m)
        end = tl.load(OFFS + e)
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        r_ok = rows < end
        c_ok = cols < C
        a_ptr = X + rows[:, None].to(tl.int64) * R + tl.arange(0, BK)[None, :]
        b_ptr = W + e.to(tl.int64) * swe + cols[None, :] * swc + tl.arange(0, BK)[:, None] * swr
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, R, BK):
            if EVEN_K:
                a = tl.load(a_ptr, mask=r_ok[:, None], other=0.0)
                b = tl.load(b_ptr, mask=c_ok[None, :], other=0.0)
            else:
                kk = k0 + tl.arange(0, BK)
                a = tl.load(a_ptr, mask=r_ok[:, None] & (kk[None, :] < R), other=0.0)
                b = tl.load(b_ptr, mask=c_ok[None, :] & (kk[:, None] < R), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptr += BK
            b_ptr += BK * swr
        tl.store(
            Y + rows[:, None].to(tl.int64) * C + cols[None, :],
            acc.to(Y.dtype.element_ty),
            mask=r_ok[:, None] & c_ok[None, :],
        )


@triton.jit
def _gmm_rows_tma(
    X,
    W,
    Y,
    TILE_E,
    TILE_ROW,
    OFFS,
    BOUNDS,
    LO,
    HI,
    M,
    C,
    R,
    E,
    TILES_N,
    NUM_SMS,
    TRANS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WS: tl.constexpr,
    FLAT: tl.constexpr,
    STORE: tl.constexpr,
    PREC: tl.constexpr,
):
    """``_gmm_rows`` as a persistent kernel whose tiles come in through TMA descriptors made on
    the device (with ``WS``, a warp-specialised loop: loads and MMAs in their own warps; with
    ``FLAT``, the tile and reduction loops pipelined as one, so the next tile's loads overlap
    this one's stores).

    It visits the row tiles BOUNDS[LO] to BOUNDS[HI] (``_tiles``: on the device). Its rows past
    the group's end (the next group's rows, or TMA's zeros past M) are read, never stored. W is
    one 2-D tensor [E * C, R] (or [E * R, C] with ``TRANS``, the reduction then in whole BK
    blocks of one expert: R % BK == 0). ``STORE``: 0 masked stores, 1 a TMA store (only for
    tiles whose rows all belong to their group), 2 two TMA stores of half the columns each (half
    the shared memory)."""
    x_d = tl.make_tensor_descriptor(X, shape=[M, R], strides=[R, 1], block_shape=[BM, BK])
    if TRANS:
        w_d = tl.make_tensor_descriptor(W, shape=[E * R, C], strides=[C, 1], block_shape=[BK, BN])
    else:
        w_d = tl.make_tensor_descriptor(W, shape=[E * C, R], strides=[R, 1], block_shape=[BN, BK])
    if STORE == 2:
        y_d = tl.make_tensor_descriptor(Y, shape=[M, C], strides=[C, 1], block_shape=[BM, BN // 2])
    elif STORE == 1:
        y_d = tl.make_tensor_descriptor(Y, shape=[M, C], strides=[C, 1], block_shape=[BM, BN])
    first = tl.load(BOUNDS + LO) * TILES_N
    tile_c = first + tl.program_id(0) - NUM_SMS  # the epilogue's own count (pipelining keeps it apart)
    for i in tl.range(
        tl.program_id(0), tl.load(BOUNDS + HI) * TILES_N - first, NUM_SMS, flatten=FLAT, warp_specialize=WS
    ):
        tile = first + i
        e = tl.load(TILE_E + tile // TILES_N)
        row0 = tl.load(TILE_ROW + tile // TILES_N)
        col0 = (tile % TILES_N) * BN
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, R, BK):
            a = x_d.load([row0, k0])
            if TRANS:
                acc = tl.dot(a, w_d.load([e * R + k0, col0]), acc, input_precision=PREC)
            else:
                acc = tl.dot(a, tl.trans(w_d.load([e * C + col0, k0])), acc, input_precision=PREC)
        tile_c += NUM_SMS
        row0 = tl.load(TILE_ROW + tile_c // TILES_N)
        end = tl.load(OFFS + tl.load(TILE_E + tile_c // TILES_N))
        col0 = (tile_c % TILES_N) * BN
        out = acc.to(Y.dtype.element_ty)
        if STORE == 0:
            rows = row0 + tl.arange(0, BM)
            cols = col0 + tl.arange(0, BN)
            ok = (rows < end)[:, None] & (cols < C)[None, :]
            tl.store(Y + rows[:, None].to(tl.int64) * C + cols[None, :], out, mask=ok)
        elif STORE == 2:  # TMA clips the columns past C
            lo, hi = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
            y_d.store([row0, col0], lo)
            y_d.store([row0, col0 + BN // 2], hi)
        else:
            y_d.store([row0, col0], out)


@triton.jit
def _gmm_weights(DY, X, DW, OFFS, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """DW[e] = DY_e^T X_e: the reduction over group e's rows."""
    pid_n, pid_k, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    end = tl.load(OFFS + e)
    ns = pid_n * BN + tl.arange(0, BN)
    ks = pid_k * BK + tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    for m0 in range(start, end, BM):
        rows = m0 + tl.arange(0, BM)
        ok = rows < end
        dy = tl.load(DY + rows[:, None].to(tl.int64) * N + ns[None, :], mask=ok[:, None] & (ns[None, :] < N), other=0.0)
        x = tl.load(X + rows[:, None].to(tl.int64) * K + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PREC)
    tl.store(
        DW + e.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :],
        acc.to(DW.dtype.element_ty),
        mask=(ns[:, None] < N) & (ks[None, :] < K),
    )


@triton.jit
def _gmm_weights_tma(
    DY,
    X,
    DW,
    OFFS,
    N,
    K,
    E,
    TILES_N,
    TILES_K,
    NUM_SMS,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WS: tl.constexpr,
    FLAT: tl.constexpr,
    PREC: tl.constexpr,
):
    """``_gmm_weights`` as a persistent kernel over the tiles (expert, N block, K block): each
    reads its group's rows through descriptors made for that group on the device, whose shape
    ends at the group's last row (TMA fills the last block past it with zeros: no masks).
    ``WS`` and ``FLAT`` as in ``_gmm_rows_tma``. (One descriptor per tensor, made once, with the
    next group's rows zeroed in registers, was slower in all four variants tried: bench/RESULTS.md,
    "MoE grouped GEMM at torch's speed".)"""
    per_e = TILES_N * TILES_K
    for tile in tl.range(tl.program_id(0), E * per_e, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        e = tile // per_e
        pid_n = (tile % per_e) // TILES_K
        pid_k = tile % TILES_K
        start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
        rows = tl.load(OFFS + e) - start
        dy_d = tl.make_tensor_descriptor(
            DY + start.to(tl.int64) * N, shape=[tl.maximum(rows, 1), N], strides=[N, 1], block_shape=[BM, BN]
        )
        x_d = tl.make_tensor_descriptor(
            X + start.to(tl.int64) * K, shape=[tl.maximum(rows, 1), K], strides=[K, 1], block_shape=[BM, BK]
        )
        acc = tl.zeros([BN, BK], tl.float32)
        for m0 in range(0, rows, BM):
            acc = tl.dot(tl.trans(dy_d.load([m0, pid_n * BN])), x_d.load([m0, pid_k * BK]), acc, input_precision=PREC)
        ns = pid_n * BN + tl.arange(0, BN)
        ks = pid_k * BK + tl.arange(0, BK)
        tl.store(
            DW + e.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :],
            acc.to(DW.dtype.element_ty),
            mask=(ns[:, None] < N) & (ks[None, :] < K),
        )


@triton.jit
def _tile_table(OFFS, TILE_E, TILE_ROW, BOUNDS, E, n, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr):
    """``_tiles``' table for the tiles of one block of BT (each program reads all E offsets)."""
    g = tl.arange(0, BE)
    end = tl.load(OFFS + g, mask=g < E, other=0)
    start = tl.load(OFFS + g - 1, mask=(g > 0) & (g < E), other=0)
    count = end - start
    per = (count + BM - 1) // BM
    per_w = tl.where(count >= BM, per, 0)  # the whole groups' tiles, then the short groups'
    per_s = per - per_w
    n_w = tl.sum(per_w, 0)
    n_used = n_w + tl.sum(per_s, 0)
    ends_w = tl.cumsum(per_w, 0)
    ends_s = tl.cumsum(per_s, 0) + n_w
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    w = t < n_w
    e = tl.where(
        w,
        tl.sum((ends_w[None, :] <= t[:, None]).to(tl.int32), 1),
        tl.sum((ends_s[None, :] <= t[:, None]).to(tl.int32), 1),
    )
    hit = g[None, :] == e[:, None]
    first = tl.where(w[:, None], (ends_w - per_w)[None, :], (ends_s - per_s)[None, :])
    first = tl.sum(tl.where(hit, first, 0), 1)
    row = tl.sum(tl.where(hit, start[None, :], 0), 1) + (t - first) * BM
    row = tl.where(w, tl.minimum(row, tl.sum(tl.where(hit, end[None, :], 0), 1) - BM), row)
    used = t < n_used
    tl.store(TILE_E + t, tl.where(used, e, -1), mask=t < n)
    tl.store(TILE_ROW + t, tl.where(used, row, 0), mask=t < n)
    if tl.program_id(0) == 0:
        tl.store(BOUNDS, 0)
        tl.store(BOUNDS + 1, n_w)
        tl.store(BOUNDS + 2, n_used)


def _tiles(offs: torch.Tensor, M: int, BM: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """The row tiles, on the device: each one's group (-1: unused) and first row, and their
    bounds [0, whole, used]. The tiles of the groups of at least BM rows come first, and each of
    them lies inside its group: the group's last tile ends at its last row (overlapping the tile
    before; both write the same values there). Then one tile for each smaller group, which runs
    past its end. One launch (the table is built for every GEMM: torch's ops took ~35)."""
    E = offs.shape[0]
    n = triton.cdiv(M, BM) + E
    BE = triton.next_power_of_2(E)
    BT = max(16, 8192 // BE)
    tile_e = torch.empty(n, dtype=torch.int32, device=offs.device)
    tile_row = torch.empty(n, dtype=torch.int32, device=offs.device)
    bounds = torch.empty(3, dtype=torch.int32, device=offs.device)
    _tile_table[(triton.cdiv(n, BT),)](offs, tile_e, tile_row, bounds, E, n, BM=BM, BE=BE, BT=BT)
    return tile_e, tile_row, n, bounds


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the TMA descriptors that kernels make on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _tma_ok(a: torch.Tensor, b: torch.Tensor, R: int, C: int) -> bool:
    """Whether the TMA kernels can take a [., R] and b [., C]: Hopper or later (or the
    interpreter), b contiguous, 16-byte row strides and bases."""
    size = a.element_size()
    hopper = not a.is_cuda or torch.cuda.get_device_capability(a.device)[0] >= 9
    return (
        hopper
        and b.is_contiguous()
        and (R * size) % 16 == 0
        and (C * size) % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
    )


def _rows_gemm(x: torch.Tensor, W: torch.Tensor, offs: torch.Tensor, transpose: bool) -> torch.Tensor:
    """x [M, R] times W_e^T (W [E, C, R]) or, with ``transpose``, times W_e (W [E, R, C])."""
    M, R = x.shape
    C = W.shape[2] if transpose else W.shape[1]
    swe, s1, s2 = W.stride()
    swc, swr = (s2, s1) if transpose else (s1, s2)
    cfg = _config(x, "rows")
    tma = cfg.pop("TMA", False)
    tma_args = {key: cfg.pop(key, 0) for key in ("WS", "FLAT", "STORE")}
    # dx's reduction runs down W's rows across experts: whole BK blocks of one expert only
    tma = tma and _tma_ok(x, W, R, C) and (not transpose or R % cfg["BK"] == 0)
    tile_e, tile_row, n, bounds = _tiles(offs, M, cfg["BM"])
    y = torch.empty(M, C, dtype=x.dtype, device=x.device)
    if M:
        cols = triton.cdiv(C, cfg["BN"])
        if tma:
            triton.set_allocator(_alloc)
            grid = min(sms(x), n * cols)
            cfg.pop("GROUP", None)
            store = tma_args.pop("STORE")
            # TMA stores for the tiles inside their groups, then masked stores for the short groups'
            for lo, hi, how in [(0, 1, store), (1, 2, 0)] if store else [(0, 2, 0)]:
                _gmm_rows_tma[(grid,)](
                    x,
                    W,
                    y,
                    tile_e,
                    tile_row,
                    offs,
                    bounds,
                    lo,
                    hi,
                    M,
                    C,
                    R,
                    W.shape[0],
                    cols,
                    grid,
                    TRANS=transpose,
                    PREC=dot_precision(x),
                    STORE=how,
                    **tma_args,
                    **cfg,
                )
        else:
            _gmm_rows[(n * cols,)](
                x,
                W,
                y,
                tile_e,
                tile_row,
                offs,
                C,
                R,
                swe,
                swc,
                swr,
                n,
                cols,
                EVEN_K=R % cfg["BK"] == 0,
                PREC=dot_precision(x),
                **cfg,
            )
    return y


def _weights_gemm(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, E: int) -> torch.Tensor:
    """dW_e = dy_e^T x_e: [E, N, K]."""
    N, K = dy.shape[1], x.shape[1]
    dW = torch.empty(E, N, K, dtype=x.dtype, device=x.device)
    cfg = _config(x, "weights")
    tma = cfg.pop("TMA", False) and _tma_ok(dy, x, N, K)
    tma_args = {key: cfg.pop(key, 0) for key in ("WS", "FLAT")}
    tn, tk = triton.cdiv(N, cfg["BN"]), triton.cdiv(K, cfg["BK"])
    if tma:
        triton.set_allocator(_alloc)
        grid = min(sms(x), E * tn * tk)
        _gmm_weights_tma[(grid,)](dy, x, dW, offs, N, K, E, tn, tk, grid, PREC=dot_precision(x), **tma_args, **cfg)
    else:
        _gmm_weights[(tn, tk, E)](dy, x, dW, offs, N, K, PREC=dot_precision(x), **cfg)
    return dW


class _GMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, offs):
        x, W = x.contiguous(), W.contiguous()
        ctx.save_for_backward(x, W, offs)
        return _rows_gemm(x, W, offs, transpose=False)

    @staticmethod
    def backward(ctx, dy):
        x, W, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _rows_gemm(dy, W, offs, transpose=True) if ctx.needs_input_grad[0] else None
        dW = _weights_gemm(dy, x, offs, W.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dW, None


def gmm(x_MK: torch.Tensor, W_ENK: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group e times W_e^T: [M, K] x [E, N, K] -> [M, N] (``offs``: the groups' ends, int32)."""
    return _GMM.apply(x_MK, W_ENK.to(x_MK.dtype), offs)


def grouped_mlp(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    return mlp(gmm, x_MD, counts_E, gate_up_E2ID, down_EDI, act, lora, scaling, w_M=w_M)
