"""DSA's sparse attention on Hopper (sm_90), in Gluon: the forward and the backward's walk, for
the model's case only (MLA's absorbed latent: q/k 576 = 512 + 64, the values the keys' first 512
dims; bf16 or fp16; 64 query heads a key head, or a multiple). The same arguments and outputs as
``triton._attn_fwd`` and ``triton._attn_bwd`` with ``SHARED``; ``triton.py`` picks these where
``fits``, the forward only where ``forward_checked`` too.

Why not Triton: its software pipeline issues a block's key gather after the block before it
has been multiplied, at the end of an iteration, and waits for it at the top of the next, so
the gather overlaps only the forward's P V product (``bench.regs``; bench/RESULTS.md,
2026-12-07). Here the order is written out, two buffers of key rows: block i + 1's rows are
gathered (cp.async) while block i's products and softmax run.

Forward: a program per (query, key head, block of 64 query heads), two warp groups as
warp-specialized partitions split by dims: group 0 takes the q/k dims [0, 256) and the value
dims [0, 256), group 1 the q/k dims [256, 576) and the value dims [256, 512). Each gathers its
own dims of the selected rows into its own buffers, so that neither waits on the other's copies.
The scores are the sum of the two groups' partial products: group 0 writes its partial into one
fp32 slot in shared memory and signals (mbarrier); group 1 reads it, writes its own and signals;
both add them in the same order, so both hold the same scores, and the softmax's row statistics
and P stay in each group's own warps (one program of 8 warps splitting the keys instead crossed
them between the warp groups through shared memory, twelve barriers a block: 1.28x slower on an
H100, bench/RESULTS.md, 2026-12-08). Walk: one warp group, 32 keys a block (q, do and two blocks
of rows fill the shared memory).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

BH = 64  # query heads a program: one wgmma's rows
BK = 64  # the forward's keys a block
WARPS = 4  # the forward's first warp group; the second is a worker partition of 4 more
WALK_BK = 32  # the walk's keys a block: q, do and two blocks of rows in shared memory
WALK_WARPS = 4


def fits(q: torch.Tensor, k: torch.Tensor, HG: int, DA: int, DB: int) -> bool:
    """These kernels take these inputs (on a Hopper GPU): the dims they were tested at (MLA's
    absorbed 576 = 512 + 64), 16-bit, whole 64-head blocks, keys under 2**31 elements (the
    forward's row offsets are int32). Shared memory: the forward's q, two key blocks and the
    scores' slot, 224 KB; the walk's q, do and two blocks of 32 keys, 210 KB."""
    dims = q.dtype in (torch.bfloat16, torch.float16) and HG % BH == 0 and (DA, DB) == (512, 64)
    return dims and k.numel() < 2**31


def forward_checked(H: int, G: int) -> bool:
    """Where ``forward`` runs (``triton._hopper_forward``): the model's one block of 64 heads on
    one key head, the shape it was checked at on an H100 (2026-12-08: 16k tokens of one sequence,
    its outputs within 2**-7 and its lse within 7e-6 of the earlier forward's, written into the
    same buffers; its stores are unmasked and cover every output). Its reference tests
    (``tests/gpu/test_dsa_cuda.py``: two head blocks, two key heads, packed documents, batches of
    two) have not run on a GPU yet; elsewhere the Triton forward runs."""
    return H == BH and G == 1


@gluon.jit
def _index(IDX, base, k0, cnt, BK: gl.constexpr, layout: gl.constexpr):
    """Block k0 of a query's selected keys: which are real, and their positions."""
    kk = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    ok = kk < cnt
    return ok, gl.load(IDX + base + kk, mask=ok, other=0)


@gluon.jit
def _gather(X, rows, ok, ca, cb, D: gl.constexpr, xa, xb):
    """Rows of X [*, D] into shared memory, dims ca into xa and cb into xb (zeros where not ok
    or past D): asynchronous copies, not yet committed."""
    cp.async_copy_global_to_shared(xa, X + rows[:, None] * D + ca[None, :], mask=ok[:, None])
    cp.async_copy_global_to_shared(xb, X + rows[:, None] * D + cb[None, :], mask=ok[:, None] & (cb[None, :] < D))


@gluon.jit
def _rows(IDX, base, k0, cnt, first, G, g, D: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """Block k0 of a query's selected keys: which are real, and where their rows start (int32
    offsets: ``fits`` keeps the keys under 2**31 elements)."""
    ok, i = _index(IDX, base, k0, cnt, BK, layout)
    return ok, ((first + i) * G + g) * D


@gluon.jit
def _copy(X, rows, ok, c, x_s):
    """Dims c of the rows starting at ``rows`` into shared memory (zeros where not ok): asynchronous
    copies, not yet committed."""
    cp.async_copy_global_to_shared(x_s, X + rows[:, None] + c[None, :], mask=ok[:, None])


@gluon.jit
def _half(
    Q,
    Kk,
    IDX,
    CNT,
    O,
    LSE,
    q_s,
    k_s,
    kr_s,
    xs,
    bars,
    T,
    NK,
    scale2,
    H: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    DA: gl.constexpr,
    BH: gl.constexpr,
    BK: gl.constexpr,
    ME: gl.constexpr,
):
    """Warp group ``ME``'s half of the forward (the module's docstring): its q/k dims' partial
    scores, the scores summed with the other group's through ``xs`` in turns (``bars``), the
    online softmax, and its value dims of the output (group 1 writes the lse too)."""
    NW: gl.constexpr = 4
    t, bg, hb = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    b, g = bg // G, bg % G
    HG: gl.constexpr = H // G
    HALF: gl.constexpr = DA // 2
    DR: gl.constexpr = D - DA
    dt: gl.constexpr = Q.dtype.element_ty
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BK, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HALF, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    r_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)

    c = ME * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, rows_l))
    cr = DA + gl.arange(0, DR, layout=gl.SliceLayout(0, rows_l))
    heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, rows_l))
    qrow = (b * T + t).to(gl.int64) * H + g * HG + heads
    cp.async_copy_global_to_shared(q_s, Q + qrow[:, None] * D + c[None, :])
    if ME == 1:  # the rope dims of q in registers (no room in shared memory)
        hr = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, r_l))
        dr = DA + gl.arange(0, DR, layout=gl.SliceLayout(0, r_l))
        qr = gl.load(Q + ((b * T + t).to(gl.int64) * H + g * HG + hr)[:, None] * D + dr[None, :])
    cnt = gl.load(CNT + b * T + t)
    base = (b * T + t).to(gl.int64) * NK
    first = b * T
    ok, rows = _rows(IDX, base, 0, cnt, first, G, g, D, BK, rows_l)
    _copy(Kk, rows, ok, c, k_s.index(0))
    if ME == 1:
        _copy(Kk, rows, ok, cr, kr_s.index(0))
    cp.commit_group()
    ok, rows = _rows(IDX, base, BK, cnt, first, G, g, D, BK, rows_l)

    m = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l = gl.zeros([BH], gl.float32, gl.SliceLayout(1, s_l))
    acc = warpgroup_mma_init(gl.zeros([BH, HALF], gl.float32, o_l))
    keys = gl.arange(0, BK, layout=gl.SliceLayout(0, s_l))
    zero = gl.zeros([BH, BK], gl.float32, s_l)
    phase = 0
    for k0 in range(0, cnt, BK):
        buf = (k0 // BK) % 2
        # the block before's P V done (a product in flight while the next is issued would make
        # ptxas serialise every wgmma, C7514) and this block's rows copied, by every thread of
        # the group: the other buffer is free for the next block, and every thread has read
        # the block before's slot (group 0 writes it again below)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        kb = k_s.index(buf)
        part = warpgroup_mma(q_s, kb.permute((1, 0)), zero, use_acc=False, is_async=True)
        if ME == 1:
            part = warpgroup_mma(qr, kr_s.index(buf).permute((1, 0)), part, is_async=True)
        _copy(Kk, rows, ok, c, k_s.index(1 - buf))
        if ME == 1:
            _copy(Kk, rows, ok, cr, kr_s.index(1 - buf))
        cp.commit_group()
        ok, rows = _rows(IDX, base, k0 + 2 * BK, cnt, first, G, g, D, BK, rows_l)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        # the scores: group 0's partial + group 1's, the same sum in both groups. An arrive is
        # one thread's; Gluon puts the group's barrier before it (the slot's stores, every
        # thread's, are done before the other group is let read them: bar.sync in the PTX)
        if ME == 0:
            xs.store(part)
            mbarrier.arrive(bars.index(0), count=1)
            mbarrier.wait(bars.index(1), phase)
            s = part + xs.load(s_l)
        else:
            mbarrier.wait(bars.index(0), phase)
            s = xs.load(s_l) + part
            gl.thread_barrier()  # every thread has read group 0's partial
            xs.store(part)
            mbarrier.arrive(bars.index(1), count=1)
        phase ^= 1
        s = gl.where((k0 + keys < cnt)[None, :], s * scale2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l = l * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dt), p_l), kb, acc, is_async=True)
        m = m_new
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)  # the last (empty) block's copies

    l_safe = gl.where(l > 0, l, 1.0)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))[:, None]
    heads_o = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
    e = ME * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    orow = (b * T + t).to(gl.int64) * H + g * HG + heads_o
    gl.store(O + orow[:, None] * DA + e[None, :], out.to(dt))
    if ME == 1:
        heads_s = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
        srow = (b * T + t).to(gl.int64) * H + g * HG + heads_s
        gl.store(LSE + srow, m + gl.log2(l_safe))


@gluon.jit
def _fwd(
    Q,
    Kk,
    IDX,
    CNT,
    O,
    LSE,
    T,
    NK,
    scale2,
    H: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
    BH: gl.constexpr,
    BK: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``triton._attn_fwd`` with ``SHARED``: a program per (query, key head, block of 64 heads),
    each group's shared memory (its q dims, two buffers of its key dims), the scores' slot and
    its two mbarriers, then the two warp groups (``_half``; group 1 the first partition, its
    4 warps the program's ``num_warps``, group 0 a worker of 4 more)."""
    dt: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = DA // 2
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, HALF], dt)
    rl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DB], dt)
    q0 = gl.allocate_shared_memory(dt, [BH, HALF], sl)
    q1 = gl.allocate_shared_memory(dt, [BH, HALF], sl)
    k0 = gl.allocate_shared_memory(dt, [2, BK, HALF], sl)
    k1 = gl.allocate_shared_memory(dt, [2, BK, HALF], sl)
    kr = gl.allocate_shared_memory(dt, [2, BK, DB], rl)
    xs = gl.allocate_shared_memory(gl.float32, [BH, BK], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    gl.warp_specialize(
        [
            (_half, (Q, Kk, IDX, CNT, O, LSE, q1, k1, kr, xs, bars, T, NK, scale2, H, G, D, DA, BH, BK, 1)),
            (_half, (Q, Kk, IDX, CNT, O, LSE, q0, k0, kr, xs, bars, T, NK, scale2, H, G, D, DA, BH, BK, 0)),
        ],
        [4],
        [232],  # group 0's registers (no spills, bench.regs); group 1 gets the rest, 256
    )


@gluon.jit
def _walk(
    Q,
    Kk,
    IDX,
    CNT,
    DO,
    LSE,
    DELTA,
    PT,
    DST,
    P,
    T,
    NK,
    scale2,
    t0,
    NC,
    TS,
    TC,
    H: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
    HP: gl.constexpr,
    ORDERED: gl.constexpr,
    WEIGHTS: gl.constexpr,
    BH: gl.constexpr,
    BK: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``triton._attn_bwd`` with ``SHARED`` (the values the keys' first DA dims): a key block's
    p and ds written key-major into PT and DST, and with ``WEIGHTS`` the target's shares into P,
    as there. One warp group; the next block's rows gathered during this block's products."""
    i, bg, hb = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    t = t0 + i
    b, g = bg // G, bg % G
    HG: gl.constexpr = H // G
    NHB: gl.constexpr = HG // BH
    dt: gl.constexpr = Q.dtype.element_ty
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BK, 16]
    )
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])  # heads contiguous
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DA], dt)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DB], dt)
    qa_s = gl.allocate_shared_memory(dt, [BH, DA], a_sl)
    qb_s = gl.allocate_shared_memory(dt, [BH, DB], b_sl)
    do_s = gl.allocate_shared_memory(dt, [BH, DA], a_sl)
    ka_s = gl.allocate_shared_memory(dt, [2, BK, DA], a_sl)
    kb_s = gl.allocate_shared_memory(dt, [2, BK, DB], b_sl)

    ca = gl.arange(0, DA, layout=gl.SliceLayout(0, rows_l))
    cb = DA + gl.arange(0, DB, layout=gl.SliceLayout(0, rows_l))
    heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, rows_l))
    qrow = (b * T + t).to(gl.int64) * H + g * HG + heads
    _gather(Q, qrow, heads < HG, ca, cb, D, qa_s, qb_s)
    cp.async_copy_global_to_shared(do_s, DO + qrow[:, None] * DA + ca[None, :])
    heads_s = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
    srow = (b * T + t).to(gl.int64) * H + g * HG + heads_s
    lse = gl.load(LSE + srow)
    delta = gl.load(DELTA + srow)
    cnt = gl.load(CNT + b * T + t)
    base = (b * T + t).to(gl.int64) * NK
    first = (b * T).to(gl.int64)
    ok, i = _index(IDX, base, 0, cnt, BK, rows_l)
    _gather(Kk, (first + i) * G + g, ok, ca, cb, D, ka_s.index(0), kb_s.index(0))
    cp.commit_group()
    ok, i = _index(IDX, base, BK, cnt, BK, rows_l)

    keys = gl.arange(0, BK, layout=gl.SliceLayout(0, s_l))
    keys_o = gl.arange(0, BK, layout=gl.SliceLayout(0, out_l))
    cols = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, out_l))
    walked = ((b * NC + (t - t0)) * G + g).to(gl.int64) * NK
    zero = gl.zeros([BH, BK], gl.float32, s_l)
    for k0 in range(0, cnt, BK):
        buf = (k0 // BK) % 2
        cp.wait_group(0)  # this block's rows (first, the query's and do's too), by every thread
        fence_async_shared()
        gl.thread_barrier()
        _gather(Kk, (first + i) * G + g, ok, ca, cb, D, ka_s.index(1 - buf), kb_s.index(1 - buf))
        cp.commit_group()
        ok, i = _index(IDX, base, k0 + 2 * BK, cnt, BK, rows_l)
        ka = ka_s.index(buf).permute((1, 0))
        s = warpgroup_mma(qa_s, ka, zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qb_s, kb_s.index(buf).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_s, ka, zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        real = (k0 + keys < cnt)[None, :]
        p = gl.where(real, gl.exp2(s * scale2 - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        kk = k0 + keys_o
        at = (walked + kk)[None, :] * HP + cols[:, None]
        stored = (kk < cnt)[None, :]
        gl.store(DST + at, gl.convert_layout(ds.to(dt), out_l), mask=stored)
        gl.store(PT + at, gl.convert_layout(p.to(dt), out_l), mask=stored)
        if WEIGHTS:
            share = gl.sum(p, 0) / H
            kw = k0 + keys
            if ORDERED:
                slot = (((b * TC + t - TS) * G + g) * NHB + hb).to(gl.int64) * NK + kw
                gl.store(P + slot, share, mask=kw < cnt)
            elif NHB * G == 1:  # the only share
                gl.store(P + (b * T + t).to(gl.int64) * NK + kw, share, mask=kw < cnt)
            else:
                gl.atomic_add(P + (b * T + t).to(gl.int64) * NK + kw, share, mask=kw < cnt, sem="relaxed")
    cp.wait_group(0)  # the last (empty) block's copies


def forward(q, k, idx, cnt, o, lse, scale2: float, meta: dict) -> None:
    """``triton._attn_fwd`` with ``SHARED`` (o [B, T, H, DA] and lse [B, T, H] written)."""
    B, T, NK = idx.shape
    H, G = meta["H"], meta["G"]
    _fwd[(T, B * G, H // G // BH)](
        q, k, idx, cnt, o, lse, T, NK, scale2,
        H=H, G=G, D=meta["D"], DA=meta["DA"], DB=meta["DB"], BH=BH, BK=BK, num_warps=WARPS,
    )  # fmt: skip


def walk(q, k, idx, cnt, do, lse, delta, pt, dst, p, scale2: float, chunk, n: int, meta: dict) -> None:
    """``triton._attn_bwd`` with ``SHARED`` for the chunk's n queries (``chunk``: t0, NC, TS, TC)."""
    B, T, NK = idx.shape
    H, G = meta["H"], meta["G"]
    _walk[(n, B * G, H // G // BH)](
        q, k, idx, cnt, do, lse, delta, pt, dst, p, T, NK, scale2, *chunk,
        H=H, G=G, D=meta["D"], DA=meta["DA"], DB=meta["DB"], HP=meta["HP"], ORDERED=meta["ORDERED"],
        WEIGHTS=meta["WEIGHTS"], BH=BH, BK=WALK_BK, num_warps=WALK_WARPS,
    )  # fmt: skip
