"""DSA in Triton: the same functions as ``reference.py``, without dense [T, S] tensors outside
the indexer's top-k and without gathered copies of the keys.

- ``indexer_topk``: one kernel scores a block of queries against a block of keys (the index
  heads looped inside, ReLU and weights fused) and writes each score as an int32 in the scores'
  order (its fp32 bits, the negative ones' flipped); ``torch.topk`` gives each row's k-th best
  value only (on long rows from the keys above a bound the scoring kernel also writes: ``_kth``),
  and a second kernel walks the row once, taking every key above it and the earliest
  keys at it (ties go to the earlier key, as the reference's), into the index list in descending
  position. Queries go in chunks of at most 2 GiB of order keys; only keys up to the chunk's last
  query are scored.
- ``sparse_attention``: flash attention over each query's index list. Forward: a program per
  (query, key head, block of its query heads), online softmax over blocks of gathered keys; where
  the values are a view of the keys' first dims (MLA's absorbed latent, ``shared_values``), they
  come from the key tile already loaded. On Hopper that case (MLA's 576 = 512 + 64 dims,
  16-bit, blocks of 64 heads) runs in Gluon instead, the backward's walk and, at the model's one
  block of 64 heads on one key head, the forward (``hopper.py``: the next block's gather overlaps
  this block's products; the forward's two warp groups split by dims).
  Backward in two kernels (after each output row's do . o, ``_row_dots``), a chunk of queries
  at a time (``WALK_BYTES``). The walk, a program per
  (query, key head, block of 64 query heads: wgmma), recomputes a key block's probabilities p and
  score gradients ds and writes both in the inputs' dtype, key-major. Then a program per (column
  tile, query, key head) turns them into every gradient with products of all of a query's heads:
  the selected keys' ds^T q (+ p^T do, the values' share where they are the keys' first dims),
  one fp32 atomic add per selected key and column (under ``torch.use_deterministic_algorithms``:
  into a slot per query and key, summed by torch's deterministic ``index_add_``, in chunks of
  queries; slower, bit-reproducible), and the query's dq = ds k from the same tile's columns of
  the gathered keys. Shared values (a view of the tensor the keys are of) are read from the key
  tiles here too, and their gradient joins the keys' in that one add. With the indexer's inputs,
  the walk also writes the indexer's target (probabilities averaged over heads) from its own p,
  and the indexer's KL loss and its gradients follow in the backward: the forward walks the keys
  once (a target written in the forward took a second walk, 46% of a training forward on an
  H100).
- ``indexer_kl_loss``: a program per query recomputes its index scores on the selected keys only;
  the backward adds dk with fp32 atomics (in a fixed order when deterministic, as above).

The head dim is split into a power-of-two part and a remainder (576 = 512 + 64, 192 = 128 + 64)
so that no lane of the dot products is padding. fp32 inputs use IEEE dots.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kiln_kernels.dispatch import dot_precision, kept

NONE: tl.constexpr = tl.constexpr(-(2**31))  # the order key of a key a query may not see


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _split(D: int) -> tuple[int, int]:
    """Tiles DA + DB >= D, both powers of two, DA the largest that fits (DB all padding when D is
    itself a power of two: a small waste that keeps one code path)."""
    DA = max(16, 1 << (D.bit_length() - 1))
    return DA, _pow2(D - DA)


def _counts(idx_BTK: torch.Tensor) -> torch.Tensor:
    return (idx_BTK >= 0).sum(-1, dtype=torch.int32)


def _one_row_if_longer(q: torch.Tensor, k: torch.Tensor) -> None:
    """The attention and KL kernels find a selected key's row as b * T + index: keys longer than
    the queries (context parallel) come one row at a time."""
    if k.shape[1] != q.shape[1] and q.shape[0] != 1:
        raise ValueError(f"keys longer than the queries ({k.shape[1]} > {q.shape[1]}) need one row, got {q.shape[0]}")


# --------------------------------------------------------------------------------------------
# indexer scores and top-k


@triton.jit
def _index_keys(
    Q,
    Kx,
    W,
    STARTS,
    OUT,
    MAXES,
    t0,
    t1,
    T,
    S,
    NG,
    scale,
    J: tl.constexpr,
    DH: tl.constexpr,
    DH_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    GS: tl.constexpr,
):
    """Order keys of queries [t0, t1) against keys [0, t1 + S - T) (the queries are the last T of
    the S keys: S = T but under context parallel): each score's fp32 bits as an int32 in the
    scores' order, ``NONE`` where the key may not be seen. The key tiles are the grid's fastest
    axis: the programs running at once share one tile of queries (L2-resident) and stream the
    keys, where the other order read each query tile from memory once per key tile. ``GS``:
    the best key of each group of GS too, into MAXES [B, t1 - t0, NG] (the top-k's bound)."""
    pn, pm, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = t0 + pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    width = t1 + S - T
    row_ok = rows < t1
    col_ok = cols < width
    starts = tl.load(STARTS + b * T + rows, mask=row_ok, other=0)
    lo = tl.min(tl.where(row_ok, starts, 2147483647), 0)
    hi = tl.max(tl.where(row_ok, rows + S - T, -1), 0)
    d = tl.arange(0, DH_PAD)
    dm = d < DH
    acc = tl.zeros([BM, BN], tl.float32)
    if (pn * BN <= hi) & (pn * BN + BN > lo):
        k = tl.load(
            Kx + (b * S + cols[:, None]).to(tl.int64) * DH + d[None, :], mask=col_ok[:, None] & dm[None, :], other=0.0
        )
        for j in range(J):
            q = tl.load(
                Q + ((b * T + rows[:, None]).to(tl.int64) * J + j) * DH + d[None, :],
                mask=row_ok[:, None] & dm[None, :],
                other=0.0,
            )
            w = tl.load(W + (b * T + rows).to(tl.int64) * J + j, mask=row_ok, other=0.0).to(tl.float32) * scale
            acc += w[:, None] * tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC), 0.0)
    acc = tl.where(acc == 0.0, 0.0, acc)  # -0.0 would order below +0.0
    bits = acc.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    allowed = (cols[None, :] >= starts[:, None]) & (cols[None, :] <= rows[:, None] + S - T)
    key = tl.where(allowed, key, NONE)
    row = (b * (t1 - t0) + rows[:, None] - t0).to(tl.int64)
    tl.store(OUT + row * width + cols[None, :], key, mask=row_ok[:, None] & col_ok[None, :])
    if GS > 0:  # each group of GS keys' best, into MAXES [B, t1 - t0, NG]
        best = tl.max(tl.reshape(key, [BM, BN // GS, GS]), 2)
        group = pn * (BN // GS) + tl.arange(0, BN // GS)
        tl.store(MAXES + row * NG + group[None, :], best, mask=row_ok[:, None] & (group[None, :] < NG))


@triton.jit
def _select(KEYS, KTH, EQUAL, STARTS, IDX, t0, t1, T, S, NK, BLOCK: tl.constexpr):
    """A program per query of [t0, t1): its index list from its row of order keys. Taken: every
    key above the row's k-th best (``KTH``), then the first ``EQUAL`` keys at it (ties go to the
    earlier key), written in descending position, -1 after the last. A row with fewer allowed
    keys than k has ``KTH`` = ``NONE``: every allowed key."""
    r, b = tl.program_id(0), tl.program_id(1)
    t = t0 + r
    width = t1 + S - T
    row = (b * (t1 - t0) + r).to(tl.int64)
    kth = tl.load(KTH + row)
    equal = tl.load(EQUAL + row)
    lo = tl.load(STARTS + b * T + t)
    hi = t + S - T + 1  # the row's allowed keys: [lo, hi)
    out = IDX + (b * T + t).to(tl.int64) * NK
    total = tl.minimum(hi - lo, NK)  # the list's length: the lists run backwards from it
    taken = 0
    ties = 0
    for c0 in range(lo // BLOCK * BLOCK, hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(KEYS + row * width + cols, mask=(cols >= lo) & (cols < hi), other=NONE)
        eq = ((v == kth) & (kth != NONE)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, 0) - eq  # ties before this key
        take = ((v > kth) | ((eq > 0) & (tie_rank < equal))).to(tl.int32)
        slot = taken + tl.cumsum(take, 0) - take  # in ascending position
        tl.store(out + total - 1 - slot, cols, mask=take > 0)
        taken += tl.sum(take, 0)
        ties += tl.sum(eq, 0)
    kk = total + tl.arange(0, BLOCK)
    for k0 in range(0, NK - total, BLOCK):
        tl.store(out + k0 + kk, -1, mask=k0 + kk < NK)


@triton.jit
def _above(KEYS, LOW, STARTS, CAND, COUNT, t0, t1, T, S, CAP, BLOCK: tl.constexpr):
    """A program per query of [t0, t1): its order keys above ``LOW``, packed into its row of
    CAND [B, t1 - t0, CAP] (``_kth`` makes room for all of them), and how many."""
    r, b = tl.program_id(0), tl.program_id(1)
    t = t0 + r
    width = t1 + S - T
    row = (b * (t1 - t0) + r).to(tl.int64)
    low = tl.load(LOW + row)
    lo = tl.load(STARTS + b * T + t)
    hi = t + S - T + 1
    taken = 0
    for c0 in range(lo // BLOCK * BLOCK, hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(KEYS + row * width + cols, mask=(cols >= lo) & (cols < hi), other=NONE)
        take = (v > low).to(tl.int32)
        slot = taken + tl.cumsum(take, 0) - take
        tl.store(CAND + row * CAP + slot, v, mask=(take > 0) & (slot < CAP))
        taken += tl.sum(take, 0)
    tl.store(COUNT + row, taken)


def _kth(keys: torch.Tensor, maxes: torch.Tensor | None, GS: int, starts, t0, t1, T, S, K):
    """Each row's k-th best order key and how many keys at it to take, without a host read. With
    ``maxes`` (each group of GS keys' best): the k-th best group best ``low`` bounds the k-th
    best key from below, and fewer than K groups hold a key above it, so at most (K - 1) GS keys
    lie above ``low`` (``_above`` packs them into K GS slots): the k-th best is among those when
    there are K of them, and is ``low`` itself when there are fewer. torch.topk then reads the
    groups' bests and those keys, not the rows."""
    if maxes is None:
        return _kth_of(keys, K)
    B, n = keys.shape[:2]
    low = maxes.topk(K, dim=-1, sorted=False).values.min(-1).values
    cap = K * GS
    cand = torch.full((B, n, cap), NONE.value, dtype=torch.int32, device=keys.device)
    count = torch.empty(B, n, dtype=torch.int32, device=keys.device)
    _above[(n, B)](keys, low.contiguous(), starts, cand, count, t0, t1, T, S, cap, BLOCK=1024)
    kth, equal = _kth_of(cand, K)
    above = count >= K
    return torch.where(above, kth, low), torch.where(above, equal, K - count)


def _kth_of(rows: torch.Tensor, K: int):
    """Each row's k-th best value and how many of the row's k best equal it."""
    best = rows.topk(K, dim=-1, sorted=False).values
    kth = best.min(-1).values
    return kth, K - (best > kth[..., None]).sum(-1, dtype=torch.int32)


def indexer_topk(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, starts_BT: torch.Tensor, topk: int
) -> torch.Tensor:
    B, T, J, DH = q_BTJD.shape
    S = k_BSD.shape[1]
    K = min(topk, S)
    q, k, w = q_BTJD.contiguous(), k_BSD.contiguous(), w_BTJ.contiguous()
    starts = starts_BT.to(torch.int32).contiguous()
    idx = torch.empty((B, T, K), dtype=torch.int32, device=q.device)
    cfg = CONFIG["index"]
    BM, BN = cfg["BM"], cfg["BN"]
    GS, share = min(CONFIG["topk"]["GS"], BN), CONFIG["topk"]["share"]
    rows = max(BM, (2**31 // 4) // (B * S) // BM * BM)  # queries per chunk: at most 2 GiB of order keys
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        width = t1 + S - T  # the keys these queries may see, at most
        keys = torch.empty(B, t1 - t0, width, dtype=torch.int32, device=q.device)
        ng = triton.cdiv(width, GS)
        bound = ng >= K and ng + K * GS < width * share  # torch.topk then reads less than ``share`` of it
        maxes = torch.empty(B, t1 - t0, ng, dtype=torch.int32, device=q.device) if bound else None
        grid = (triton.cdiv(width, BN), triton.cdiv(t1 - t0, BM), B)
        _index_keys[grid](
            q, k, w, starts, keys, keys if maxes is None else maxes, t0, t1, T, S, ng, DH**-0.5,
            J=J, DH=DH, DH_PAD=_pow2(DH), PREC=dot_precision(q), **cfg, GS=0 if maxes is None else GS,
        )  # fmt: skip
        if width > K:  # the k-th best key of each row, and how many of that value to take
            kth, equal = _kth(keys, maxes, GS, starts, t0, t1, T, S, K)
        else:  # no row has more keys than k: every allowed key
            kth = torch.full((B, t1 - t0), NONE.value, dtype=torch.int32, device=q.device)
            equal = torch.zeros_like(kth)
        _select[(t1 - t0, B)](keys, kth.contiguous(), equal.contiguous(), starts, idx, t0, t1, T, S, K, BLOCK=1024)
    return idx


# --------------------------------------------------------------------------------------------
# sparse attention


@triton.jit
def _rows(X, row, ok, D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
    """Rows of X [*, D] as two tiles: dims [0, DA) and [DA, DA + DB) (masked past D)."""
    da = tl.arange(0, DA)
    db = DA + tl.arange(0, DB)
    a = tl.load(X + row[:, None] * D + da[None, :], mask=ok[:, None], other=0.0)
    b = tl.load(X + row[:, None] * D + db[None, :], mask=ok[:, None] & (db[None, :] < D), other=0.0)
    return a, b


@triton.jit
def _keys(IDX, b, t, T, NK, G, g, k0, cnt, BK: tl.constexpr):
    """Block k0 of query t's selected keys: which are real, and their rows in K [B*T*G, D]."""
    kk = k0 + tl.arange(0, BK)
    ok = kk < cnt
    idx = tl.load(IDX + (b * T + t).to(tl.int64) * NK + kk, mask=ok, other=0)
    return kk, ok, (b * T + idx).to(tl.int64) * G + g


@triton.jit
def _scores(qa, qb, ka, kb, PREC: tl.constexpr):
    """q . k of a head block and a key block, over the head dim's two tiles."""
    return tl.dot(qa, tl.trans(ka), input_precision=PREC) + tl.dot(qb, tl.trans(kb), input_precision=PREC)


@triton.jit
def _probs(qa, qb, ka, kb, lse, ok, scale2, PREC: tl.constexpr):
    """The probabilities of a head block on a key block from the heads' log-sum-exps (base 2),
    0 on keys past the count (and on heads whose lse is inf)."""
    return tl.where(ok[None, :], tl.exp2(_scores(qa, qb, ka, kb, PREC) * scale2 - lse[:, None]), 0.0)


@triton.jit
def _values(V, krow, ok, e, E: tl.constexpr):
    """The selected rows' values [BK, len(e)], dims e of E."""
    return tl.load(V + krow[:, None] * E + e[None, :], mask=ok[:, None] & (e[None, :] < E), other=0.0)


@triton.jit
def _attn_fwd(
    Q,
    Kk,
    V,
    IDX,
    CNT,
    O,
    LSE,
    T,
    NK,
    scale2,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    E: tl.constexpr,
    EB: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    SHARED: tl.constexpr,
):
    """A program per (query, key head, block of BH query heads x EB value dims). ``SHARED``: the
    values are the keys' first E = DA dims (MLA's absorbed form, the latent both), taken from
    the key tile already loaded (EB = E): a selected row is read once, not twice."""
    t, bg, he = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, g = bg // G, bg % G
    HG: tl.constexpr = H // G
    NE: tl.constexpr = (E + EB - 1) // EB
    heads = (he // NE) * BH + tl.arange(0, BH)
    e = (he % NE) * EB + tl.arange(0, EB)
    h_ok = heads < HG
    qrow = (b * T + t).to(tl.int64) * H + g * HG + heads
    qa, qb = _rows(Q, qrow, h_ok, D, DA, DB)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, EB], tl.float32)
    cnt = tl.load(CNT + b * T + t)
    for k0 in range(0, cnt, BK):
        kk, ok, krow = _keys(IDX, b, t, T, NK, G, g, k0, cnt, BK)
        ka, kb = _rows(Kk, krow, ok, D, DA, DB)
        s = tl.where(ok[None, :], _scores(qa, qb, ka, kb, PREC) * scale2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = ka if SHARED else _values(V, krow, ok, e, E)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)
    tl.store(
        O + qrow[:, None] * E + e[None, :],
        (acc / l_safe[:, None]).to(O.dtype.element_ty),
        mask=h_ok[:, None] & (e[None, :] < E),
    )
    lse = m + tl.log2(l_safe)
    if he % NE == 0:
        tl.store(LSE + qrow, lse, mask=h_ok)


@triton.jit
def _grads(qa, qb, do, lse, delta, ok, ka, kb, v, scale2, PREC: tl.constexpr):
    """Probabilities p and score gradients ds (w.r.t. scale * q . k) of a head block and a key block."""
    p = _probs(qa, qb, ka, kb, lse, ok, scale2, PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _head_block(
    Q,
    DO,
    LSE,
    DELTA,
    b,
    t,
    T,
    g,
    h0,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BH: tl.constexpr,
):
    HG: tl.constexpr = H // G
    heads = h0 + tl.arange(0, BH)
    h_ok = heads < HG
    qrow = (b * T + t).to(tl.int64) * H + g * HG + heads
    qa, qb = _rows(Q, qrow, h_ok, D, DA, DB)
    e = tl.arange(0, E_PAD)
    do = tl.load(DO + qrow[:, None] * E + e[None, :], mask=h_ok[:, None] & (e[None, :] < E), other=0.0)
    lse = tl.load(LSE + qrow, mask=h_ok, other=float("inf"))  # p = 0 on padding heads
    delta = tl.load(DELTA + qrow, mask=h_ok, other=0.0)
    return qrow, h_ok, qa, qb, do, lse, delta


@triton.jit
def _attn_bwd(
    Q,
    Kk,
    V,
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
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    HP: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    ORDERED: tl.constexpr,
    SHARED: tl.constexpr,
    WEIGHTS: tl.constexpr,
):
    """The queries' walk, a program per (query t0 + i, key head, block of BH query heads): a key
    block's probabilities p and score gradients ds (w.r.t. scale * q . k), written in the inputs'
    dtype to PT and DST [B, NC, G, NK, HP] (key-major, the block's heads at columns hb * BH) for
    ``_key_shares``, which turns them into every gradient. ``SHARED`` (the values are the keys'
    first E = DA dims): values from the key tile. ``WEIGHTS``: the indexer's target, the
    probabilities averaged over all H heads, from the walk's own p: the block's share stored into
    P [B, T, NK] where it is the only one, else added (``ORDERED``: stored in its own slot of
    P [B, TC, G, NHB, NK], queries from TS)."""
    i, bg, hb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = t0 + i
    b, g = bg // G, bg % G
    HG: tl.constexpr = H // G
    NHB: tl.constexpr = (HG + BH - 1) // BH
    _qrow, _h_ok, qa, qb, do, lse, delta = _head_block(
        Q, DO, LSE, DELTA, b, t, T, g, hb * BH, H, G, D, DA, DB, E, E_PAD, BH
    )
    e = tl.arange(0, E_PAD)
    cols = hb * BH + tl.arange(0, BH)
    walked = ((b * NC + i) * G + g).to(tl.int64) * NK
    cnt = tl.load(CNT + b * T + t)
    for k0 in range(0, cnt, BK):
        kk, ok, krow = _keys(IDX, b, t, T, NK, G, g, k0, cnt, BK)
        ka, kb = _rows(Kk, krow, ok, D, DA, DB)
        v = ka if SHARED else _values(V, krow, ok, e, E)
        p, ds = _grads(qa, qb, do, lse, delta, ok, ka, kb, v, scale2, PREC)
        at = (walked + kk)[None, :] * HP + cols[:, None]
        tl.store(DST + at, ds.to(DST.dtype.element_ty), mask=ok[None, :])
        tl.store(PT + at, p.to(PT.dtype.element_ty), mask=ok[None, :])
        if WEIGHTS:
            share = tl.sum(p, 0) / H
            if ORDERED:
                slot = (((b * TC + t - TS) * G + g) * NHB + hb).to(tl.int64) * NK + kk
                tl.store(P + slot, share, mask=ok)
            elif NHB * G == 1:  # the only share
                tl.store(P + (b * T + t).to(tl.int64) * NK + kk, share, mask=ok)
            else:
                tl.atomic_add(P + (b * T + t).to(tl.int64) * NK + kk, share, mask=ok, sem="relaxed")


@triton.jit
def _key_shares(
    A,
    X,
    A2,
    X2,
    Kk,
    DQ,
    IDX,
    CNT,
    OUT,
    T,
    NK,
    s,
    t0,
    NC,
    TS,
    TC,
    C0,
    C1,
    H: tl.constexpr,
    G: tl.constexpr,
    DX: tl.constexpr,
    DX2: tl.constexpr,
    W: tl.constexpr,
    HP: tl.constexpr,
    NT: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    ADD: tl.constexpr,
    QGRAD: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Gradient columns [C0, C1) from the queries' walk, a program per (column tile, query t0 + i,
    key head), A and A2 the walk's [B, NC, G, NK, HP] key-major p or ds, X and X2 the query's
    rows of q or do: the selected keys' OUT[key, c] += s * sum_h A[key, h] X[h, c] (+ A2[key, h]
    X2[h, c] with ``ADD``), each block of keys one product of all the query's heads, then one fp32
    atomic add per key into OUT [B*T*G, W] (``ORDERED``: a store into the key's own slot of OUT
    [B, TC, G, NK, W], queries from TS). ``QGRAD`` (A is ds, X is q): the query's
    DQ[h, c] = s * sum_key A[key, h] K[key, c] too, from the tile's columns of the gathered keys
    Kk [B*T*G, DX]."""
    n, i, bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = t0 + i
    b, g = bg // G, bg % G
    HG: tl.constexpr = H // G
    heads = tl.arange(0, HP)
    h_ok = heads < HG
    qrow = (b * T + t).to(tl.int64) * H + g * HG + heads
    c = C0 + n * NT + tl.arange(0, NT)
    c_ok = c < C1
    x = tl.load(X + qrow[:, None] * DX + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    if ADD:
        x2 = tl.load(X2 + qrow[:, None] * DX2 + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    dq = tl.zeros([HP, NT], tl.float32)
    walked = ((b * NC + i) * G + g).to(tl.int64) * NK
    cnt = tl.load(CNT + b * T + t)
    for k0 in range(0, cnt, BK):
        kk, ok, krow = _keys(IDX, b, t, T, NK, G, g, k0, cnt, BK)
        at = (walked + kk)[:, None] * HP + heads[None, :]
        a = tl.load(A + at, mask=ok[:, None] & h_ok[None, :], other=0.0)
        acc = tl.dot(a, x, input_precision=PREC) * s
        if ADD:
            a2 = tl.load(A2 + at, mask=ok[:, None] & h_ok[None, :], other=0.0)
            acc += tl.dot(a2, x2, input_precision=PREC)
        if QGRAD:
            k = tl.load(Kk + krow[:, None] * DX + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            dq += tl.dot(tl.trans(a), k, input_precision=PREC)
        if ORDERED:
            slot = ((b * TC + t - TS) * G + g).to(tl.int64) * NK + kk
            tl.store(OUT + slot[:, None] * W + c[None, :], acc, mask=ok[:, None] & c_ok[None, :])
        else:
            tl.atomic_add(OUT + krow[:, None] * W + c[None, :], acc, mask=ok[:, None] & c_ok[None, :], sem="relaxed")
    if QGRAD:
        tl.store(
            DQ + qrow[:, None] * DX + c[None, :], (dq * s).to(DQ.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :]
        )


# block sizes and warps per kernel; bench/dsa.py --tune measures others
CONFIG: dict[str, dict[str, Any]] = {
    # key tiles the grid's fastest axis; this tile's scoring 1.33x-1.78x 128 x 128's with query
    # tiles fastest (H100, 16k-128k)
    "index": dict(BM=64, BN=128, num_warps=4, num_stages=3),
    "fwd": dict(BH=64, EB=512, BK=32, num_warps=8),
    # values from the key tile: no value tile of their own, so 64 keys a block fit (bench.regs)
    "fwd shared": dict(BH=64, EB=512, BK=64, num_warps=8),
    # the backward's walk: 64 heads (wgmma); 32 keys with separate values: 276 KB (bench.regs)
    "bwd": dict(BH=64, BK=16, num_warps=8, num_stages=2),
    # 64 keys in one stage 1.06x 32 in two; 4 warps 1.03x-1.05x 8 (H100, 16k-32k)
    "bwd shared": dict(BH=64, BK=64, num_warps=4, num_stages=1),
    # columns x keys, NT for 64 heads, halved at 128 and for fp32; 1.10x 128 x 64 on 4 warps (H100, 16k)
    "keys": dict(NT=128, BK=128, num_warps=8),
    # the top-k's bound (_kth): keys a group, and the share of the order keys torch.topk must read
    # less than for the bound to be used
    "topk": dict(GS=4, share=0.75),
    "kl fwd": dict(BK=32, num_warps=4),
    "kl bwd": dict(BK=64, num_warps=4),  # the loss's forward + backward 1.3x 16 keys' (H100, 16k)
}


ORDERED_BYTES = 2**29  # the buffers of one chunk of a deterministic backward
WALK_BYTES = 2**29  # the backward's p and ds of a chunk of queries, together


def _key_grads(launch, idx_BTK: torch.Tensor, G: int, outs: list[torch.Tensor]) -> None:
    """Run a backward kernel that adds each query's shares into its selected keys' rows of
    ``outs`` (fp32, [B, T, G, width] or [B, T, width] for G = 1): ``launch(t0, queries, targets,
    ordered)``. By fp32 atomics, at once; under ``torch.use_deterministic_algorithms`` (where the
    atomics would make every run differ) in chunks of queries, each query writing a slot per key
    into zeroed buffers [B, queries, G, NK, width] (at most ``ORDERED_BYTES`` at once) that
    torch's deterministic ``index_add_`` then sums. A slot past a query's count stays zero and
    adds to row 0."""
    B, T, NK = idx_BTK.shape
    if not torch.are_deterministic_algorithms_enabled():
        launch(0, T, outs, False)
        return
    widths = [o.shape[-1] for o in outs]
    tc = max(1, min(T, ORDERED_BYTES // (4 * B * G * NK * sum(widths))))
    b = torch.arange(B, device=idx_BTK.device)[:, None, None, None]
    g = torch.arange(G, device=idx_BTK.device)[None, None, :, None]
    for t0 in range(0, T, tc):
        n = min(tc, T - t0)
        keys = idx_BTK[:, t0 : t0 + n, None, :].clamp(min=0).long()
        rows = ((b * T + keys) * G + g).expand(B, n, G, NK).reshape(-1)
        bufs = [torch.zeros(B, n, G, NK, w, device=idx_BTK.device) for w in widths]
        launch(t0, n, bufs, True)
        for out, buf, w in zip(outs, bufs, widths, strict=True):
            out.view(-1, w).index_add_(0, rows, buf.view(-1, w))


def _grads_from_walk(walk, q, k, do, dq, idx, cnt, targets, scale, shared, chunk, n, HP, ordered) -> None:
    """Every gradient of ``n`` queries from the walk's p and ds (``_attn_bwd``): dq = scale ds k,
    and into ``targets`` ([dk] or [dk, dv]) dk += scale ds^T q and dv += p^T do, each a product
    of all of a query's heads; ``shared`` (v the keys' first E dims): p^T do added into dk's first
    E columns in the same product, which then covers [0, E) with both and [E, D) with ds^T q."""
    pt, dst = walk
    B, T, H, D = q.shape
    G, E = pt.shape[2], do.shape[-1]
    if shared:
        parts = [(dst, q, pt, do, targets[0], scale, 0, E), (dst, q, None, None, targets[0], scale, E, D)]
    else:
        parts = [(dst, q, None, None, targets[0], scale, 0, D), (pt, do, None, None, targets[-1], 1.0, 0, E)]
    cfg = dict(CONFIG["keys"])
    cfg["NT"] = max(16, cfg["NT"] * 64 // max(64, HP) // (q.element_size() // 2))
    for a, x, a2, x2, out, s, c0, c1 in parts:
        if c1 <= c0:
            continue
        nt = min(cfg["NT"], _pow2(c1 - c0))
        _key_shares[(triton.cdiv(c1 - c0, nt), n, B * G)](
            a, x, a if a2 is None else a2, x if x2 is None else x2, k, dq, idx, cnt, out, T, idx.shape[-1], s,
            *chunk, c0, c1, H=H, G=G, DX=x.shape[-1], DX2=(x if x2 is None else x2).shape[-1], W=out.shape[-1],
            HP=HP, PREC=dot_precision(q), **{**cfg, "NT": nt}, ADD=a2 is not None, QGRAD=a is dst, ORDERED=ordered,
        )  # fmt: skip


@triton.jit
def _row_dot(A, B_, OUT, N, W: tl.constexpr, W_PAD: tl.constexpr, R: tl.constexpr):
    """OUT[r] = sum_c A[r, c] B_[r, c] in fp32, a program per R rows."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    c = tl.arange(0, W_PAD)
    ok = (rows < N)[:, None] & (c < W)[None, :]
    at = rows.to(tl.int64)[:, None] * W + c[None, :]
    a = tl.load(A + at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B_ + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + rows, tl.sum(a * b, 1), mask=rows < N)


def _row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a * b).sum(-1) in fp32 (a and b contiguous, of one shape), each read once (torch's fp32
    copies of a chunk at a time moved about six times their bytes)."""
    W = a.shape[-1]
    n = a.numel() // W
    out = torch.empty(a.shape[:-1], dtype=torch.float32, device=a.device)
    R = max(1, 4096 // _pow2(W))
    _row_dot[(triton.cdiv(n, R),)](a, b, out, n, W=W, W_PAD=_pow2(W), R=R, num_warps=4)
    return out


def shared_values(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v is a view of k's first E dims, E the first of the head dim's two tiles (MLA's absorbed
    form: the latent is both keys and values, 512 of 576): the forward reads values from keys."""
    return (
        k.is_contiguous()
        and v.data_ptr() == k.data_ptr()
        and v.dtype == k.dtype
        and v.shape[:-1] == k.shape[:-1]
        and v.stride() == k.stride()
        and v.shape[-1] == _split(k.shape[-1])[0]
    )


def _root(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None else x._base


def _attn_meta(q, k, v):
    B, T, H, D = q.shape
    G, E = k.shape[2], v.shape[-1]
    DA, DB = _split(D)
    return dict(H=H, G=G, D=D, DA=DA, DB=DB, E=E, PREC=dot_precision(q)), (B, T, H, G, E)


def _bh(cfg: dict, HG: int, x: torch.Tensor) -> dict:
    """The head block never larger than the group (16 at least, for the dot products); blocks
    halved for fp32 inputs, whose tiles take twice the shared memory."""
    cfg = {**cfg, "BH": min(cfg["BH"], _pow2(HG))}
    if x.element_size() == 4:
        cfg.update(BH=max(16, cfg["BH"] // 2), BK=max(16, cfg["BK"] // 2))
    return cfg


def _hopper(meta: dict, q: torch.Tensor, *more: torch.Tensor):
    """The Gluon kernels' module (``hopper.py``) where they take these inputs (``hopper.fits``)
    on an NVIDIA Hopper GPU, every tensor's rows 16-byte aligned for its copies; else None (the
    Triton kernels run)."""
    if not q.is_cuda or torch.version.hip is not None or torch.cuda.get_device_capability(q.device)[0] != 9:
        return None
    if any(x.data_ptr() % 16 for x in (q, *more)):
        return None
    from kiln_kernels.dsa import hopper  # Gluon: NVIDIA's Triton only

    return hopper if hopper.fits(q, more[0], meta["H"] // meta["G"], meta["DA"], meta["DB"]) else None


def _hopper_forward(meta: dict, q: torch.Tensor, k: torch.Tensor):
    """``_hopper`` for the forward: its Gluon kernel only where it was checked on a GPU
    (``hopper.forward_checked``), else None (the Triton forward runs)."""
    fast = _hopper(meta, q, k)
    return fast if fast is not None and fast.forward_checked(meta["H"], meta["G"]) else None


class _SparseAttention(torch.autograd.Function):
    """The attention, and with the indexer's q, k and w its KL loss against its target: the
    target (the probabilities averaged over heads) comes from the backward's walk, which computes
    every probability anyway, so the loss and its gradients are computed in the backward and the
    forward walks the keys once. The loss's value is written into the returned tensor by the
    backward (NaN before it): the step only needs its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, idx, scale, iq, ik, iw):
        shared = shared_values(k, v)  # the forward reads the values from the key tiles
        q, k, idx = q.contiguous(), k.contiguous(), idx.to(torch.int32).contiguous()
        v = v if shared else v.contiguous()
        meta, (B, T, H, G, E) = _attn_meta(q, k, v)
        NK = idx.shape[-1]
        cnt = _counts(idx)
        scale2 = scale * math.log2(math.e)
        fast = _hopper_forward(meta, q, k) if shared else None  # the forward in Gluon

        def run():
            o = torch.empty(B, T, H, E, dtype=q.dtype, device=q.device)
            lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
            if fast is not None:
                fast.forward(q, k, idx, cnt, o, lse, scale2, meta)
                return o, lse
            cfg = _bh(CONFIG["fwd shared" if shared else "fwd"], H // G, q)
            cfg["EB"] = E if shared else min(cfg["EB"], _pow2(E))
            blocks = triton.cdiv(H // G, cfg["BH"]) * triton.cdiv(E, cfg["EB"])
            _attn_fwd[(T, B * G, blocks)](q, k, v, idx, cnt, o, lse, T, NK, scale2, **meta, **cfg, SHARED=shared)
            return o, lse

        o, lse = kept("sparse_attention", run)
        # the backward reads the values from the key tiles too and adds their gradient into the
        # keys' where autograd carries it on to v's: v a view of the tensor k is of (not a
        # detached alias), and either needing no gradient or reached through k's graph
        ctx.shared = (
            shared and _root(v) is _root(k) and (not v.requires_grad or (k.requires_grad and v.grad_fn is not None))
        )
        ctx.scale = scale
        ctx.set_materialize_grads(False)  # an output nothing used sends None: its work is skipped
        if iq is None:
            ctx.save_for_backward(q, k, None if ctx.shared else v, idx, cnt, o, lse)
            return o
        loss = torch.full((), float("nan"), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, None if ctx.shared else v, idx, cnt, o, lse, *_kl_inputs(iq, ik, iw), loss)
        return o, loss

    @staticmethod
    def backward(ctx, do, dloss=None):
        q, k, v, idx, cnt, o, lse, *indexer = ctx.saved_tensors
        shared = ctx.shared
        v = k[..., : _split(k.shape[-1])[0]] if shared else v.contiguous()
        meta, (B, T, H, G, E) = _attn_meta(q, k, v)
        target = dloss is not None and any(ctx.needs_input_grad[5:])
        meta.update(E_PAD=_pow2(E), SHARED=shared, WEIGHTS=target)
        NK = idx.shape[-1]
        do = torch.zeros_like(o) if do is None else do.contiguous()
        delta = _row_dots(do, o)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = None if shared else torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        p = torch.zeros(B, T, NK, dtype=torch.float32, device=q.device) if target else None
        scale, scale2 = ctx.scale, ctx.scale * math.log2(math.e)
        cfg = _bh(CONFIG["bwd shared" if shared else "bwd"], H // G, q)
        fast = _hopper(meta, q, k, do) if shared else None  # the walk in Gluon, its head blocks its own
        if fast is not None:
            cfg["BH"] = fast.BH
        blocks = triton.cdiv(H // G, cfg["BH"])
        HP = _pow2(blocks * cfg["BH"])  # the walk's columns: every head of a key head
        nc = max(1, min(T, WALK_BYTES // (2 * B * G * NK * HP * q.element_size())))
        walk = [torch.empty(B, nc, G, NK, HP, dtype=q.dtype, device=q.device) for _ in range(2)]

        def bwd(t0, tc, targets, ordered):
            shares = torch.zeros(B, tc, G, blocks, NK, device=q.device) if ordered and target else p
            for s0 in range(t0, t0 + tc, nc):
                n = min(nc, t0 + tc - s0)
                chunk = (s0, nc, t0, tc)
                if fast is None:
                    _attn_bwd[(n, B * G, blocks)](
                        q, k, v, idx, cnt, do, lse, delta, *walk, shares, T, NK, scale2, *chunk,
                        **meta, HP=HP, **cfg, ORDERED=ordered,
                    )  # fmt: skip
                else:
                    fast.walk(
                        q, k, idx, cnt, do, lse, delta, *walk, shares, scale2, chunk, n,
                        meta | dict(HP=HP, ORDERED=ordered),
                    )  # fmt: skip
                _grads_from_walk(walk, q, k, do, dq, idx, cnt, targets, scale, shared, chunk, n, HP, ordered)
            if shares is not p:  # the heads' shares of the target summed in a fixed order
                p[:, t0 : t0 + tc] = shares.sum((2, 3))

        _key_grads(bwd, idx, G, [dk] if shared else [dk, dv])
        # shared: v's gradient is in dk (v a view of k, autograd adds nothing more for it)
        grads = (dq, dk.to(k.dtype), None if dv is None else dv.to(v.dtype), None, None)
        if not target:
            return *grads, None, None, None
        iq, ik, iw, loss = indexer
        kl, kl_lse, psum = _kl_forward(iq, ik, iw, idx, cnt, p)
        loss.copy_(kl.sum() / B)
        return *grads, *_kl_backward(iq, ik, iw, idx, cnt, p, kl_lse, psum, dloss)


def sparse_attention(
    q_BTHD: torch.Tensor,
    k_BSGD: torch.Tensor,
    v_BSGE: torch.Tensor,
    idx_BTK: torch.Tensor,
    scale: float,
    indexer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """``reference.sparse_attention``; with ``indexer``, (o, loss) where the loss's value is
    written by the backward (``_SparseAttention``)."""
    _one_row_if_longer(q_BTHD, k_BSGD)
    dt = q_BTHD.dtype
    return _SparseAttention.apply(q_BTHD, k_BSGD.to(dt), v_BSGE.to(dt), idx_BTK, scale, *(indexer or (None,) * 3))


# --------------------------------------------------------------------------------------------
# the indexer's KL loss


@triton.jit
def _index_query(Q, W, b, t, T, J: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr, J_PAD: tl.constexpr):
    """A query's index heads [J_PAD, DH_PAD] and their weights (fp32), loaded once for its loop."""
    j = tl.arange(0, J_PAD)
    d = tl.arange(0, DH_PAD)
    row = (b * T + t).to(tl.int64) * J + j
    q = tl.load(Q + row[:, None] * DH + d[None, :], mask=(j[:, None] < J) & (d[None, :] < DH), other=0.0)
    return q, tl.load(W + row, mask=j < J, other=0.0).to(tl.float32)


@triton.jit
def _index_dots(q, w, Kx, b, T, idx, ok, scale, DH: tl.constexpr, DH_PAD: tl.constexpr, PREC: tl.constexpr):
    """The selected keys' rows [BK, DH_PAD], the heads' dots with them [J_PAD, BK] and the index
    scores (-inf where not ok)."""
    d = tl.arange(0, DH_PAD)
    k = tl.load(
        Kx + (b * T + idx[:, None]).to(tl.int64) * DH + d[None, :], mask=ok[:, None] & (d[None, :] < DH), other=0.0
    )
    dots = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [J_PAD, BK]
    scores = tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0)
    return k, dots, tl.where(ok, scores, float("-inf"))


@triton.jit
def _kl_fwd(
    Q,
    Kx,
    W,
    IDX,
    CNT,
    P,
    LOSS,
    LSE,
    PSUM,
    T,
    NK,
    scale,
    J: tl.constexpr,
    DH: tl.constexpr,
    DH_PAD: tl.constexpr,
    J_PAD: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    t, b = tl.program_id(0), tl.program_id(1)
    cnt = tl.load(CNT + b * T + t)
    m = tl.full([BK], float("-inf"), tl.float32)  # per lane: a running logsumexp and the sums of p terms
    l = tl.zeros([BK], tl.float32)
    p_s = tl.zeros([BK], tl.float32)
    p_logp = tl.zeros([BK], tl.float32)
    p_sum = tl.zeros([BK], tl.float32)
    q, w = _index_query(Q, W, b, t, T, J, DH, DH_PAD, J_PAD)
    for k0 in range(0, cnt, BK):
        kk = k0 + tl.arange(0, BK)
        ok = kk < cnt
        idx = tl.load(IDX + (b * T + t).to(tl.int64) * NK + kk, mask=ok, other=0)
        _k, _d, s = _index_dots(q, w, Kx, b, T, idx, ok, scale, DH, DH_PAD, PREC)
        p = tl.load(P + (b * T + t).to(tl.int64) * NK + kk, mask=ok, other=0.0)
        m_new = tl.maximum(m, s)
        l = l * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(ok, tl.exp(s - m_new), 0.0)
        m = m_new
        pos = ok & (p > 0)
        p_s += tl.where(pos, p * s, 0.0)
        p_logp += tl.where(pos, p * tl.log(tl.where(pos, p, 1.0)), 0.0)
        p_sum += tl.where(pos, p, 0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    lse = top + tl.log(tl.maximum(tl.sum(l * tl.exp(m - top), 0), 1e-30))
    total = tl.sum(p_sum, 0)
    tl.store(LOSS + b * T + t, tl.sum(p_logp, 0) - tl.sum(p_s, 0) + total * lse)
    tl.store(LSE + b * T + t, lse)
    tl.store(PSUM + b * T + t, total)


@triton.jit
def _kl_bwd(
    Q,
    Kx,
    W,
    IDX,
    CNT,
    P,
    LSE,
    PSUM,
    GRAD,
    DQ,
    DK,
    DW,
    T,
    NK,
    scale,
    inv_B,
    t0,
    TC,
    J: tl.constexpr,
    DH: tl.constexpr,
    DH_PAD: tl.constexpr,
    J_PAD: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """A program per query; its dk shares by fp32 atomics, or (``ORDERED``, queries [t0, t0 + TC))
    into its own slots of DK [B, TC, NK, DH] as _key_shares does."""
    t, b = t0 + tl.program_id(0), tl.program_id(1)
    cnt = tl.load(CNT + b * T + t)
    lse = tl.load(LSE + b * T + t)
    total = tl.load(PSUM + b * T + t)
    grad = tl.load(GRAD).to(tl.float32) * inv_B
    j = tl.arange(0, J_PAD)
    d = tl.arange(0, DH_PAD)
    dq = tl.zeros([J_PAD, DH_PAD], tl.float32)
    dw = tl.zeros([J_PAD], tl.float32)
    q, w = _index_query(Q, W, b, t, T, J, DH, DH_PAD, J_PAD)
    for k0 in range(0, cnt, BK):
        kk = k0 + tl.arange(0, BK)
        ok = kk < cnt
        idx = tl.load(IDX + (b * T + t).to(tl.int64) * NK + kk, mask=ok, other=0)
        k, dots, s = _index_dots(q, w, Kx, b, T, idx, ok, scale, DH, DH_PAD, PREC)
        p = tl.load(P + (b * T + t).to(tl.int64) * NK + kk, mask=ok, other=0.0)
        p = tl.where(p > 0, p, 0.0)
        ds = tl.where(ok, grad * (total * tl.exp(s - lse) - p), 0.0)  # d loss / d score
        dw += tl.sum(tl.maximum(dots, 0.0) * ds[None, :], 1)
        dd = tl.where(dots > 0, w[:, None] * ds[None, :], 0.0) * scale  # d loss / d (q . k), [J_PAD, BK]
        dq += tl.dot(dd.to(k.dtype), k, input_precision=PREC)
        dk = tl.dot(tl.trans(dd.to(q.dtype)), q, input_precision=PREC)
        if ORDERED:
            slot = (b * TC + t - t0).to(tl.int64) * NK + kk
            tl.store(DK + slot[:, None] * DH + d[None, :], dk, mask=ok[:, None] & (d[None, :] < DH))
        else:
            tl.atomic_add(
                DK + (b * T + idx[:, None]).to(tl.int64) * DH + d[None, :],
                dk,
                mask=ok[:, None] & (d[None, :] < DH),
                sem="relaxed",
            )
    row = (b * T + t).to(tl.int64) * J + j
    tl.store(DQ + row[:, None] * DH + d[None, :], dq.to(DQ.dtype.element_ty), mask=(j[:, None] < J) & (d[None, :] < DH))
    tl.store(DW + row, dw.to(DW.dtype.element_ty), mask=j < J)


def _kl_meta(q, kernel: str) -> dict:
    """The KL kernels' shapes and launch (CONFIG's, set for 64 index heads of bf16; at least 32
    keys a block at 32 heads or fewer; 16 for fp32's 64 heads, whose tiles take twice the
    registers)."""
    J, DH = q.shape[2], q.shape[3]
    cfg = dict(CONFIG[kernel])
    if J <= 32:
        cfg["BK"] = max(cfg["BK"], 32)
    elif q.element_size() == 4:
        cfg["BK"] = 16
    return dict(DH=DH, DH_PAD=_pow2(DH), J_PAD=_pow2(J), PREC=dot_precision(q), **cfg)


def _kl_inputs(q, k, w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.contiguous(), k.contiguous(), w.contiguous()


def _kl_forward(q, k, w, idx, cnt, p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's loss, its index scores' log-sum-exp and its target's sum, [B, T] fp32 each."""
    B, T, J, DH = q.shape
    loss, lse, psum = (torch.empty(B, T, dtype=torch.float32, device=q.device) for _ in range(3))
    _kl_fwd[(T, B)](q, k, w, idx, cnt, p, loss, lse, psum, T, idx.shape[-1], DH**-0.5, J=J, **_kl_meta(q, "kl fwd"))
    return loss, lse, psum


def _kl_backward(q, k, w, idx, cnt, p, lse, psum, grad) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and w, the loss's gradient ``grad`` (a scalar tensor)."""
    B, T, J, DH = q.shape
    dq, dw = torch.empty_like(q), torch.empty_like(w)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    grad = grad.contiguous()

    def kl_dk(t0, tc, targets, ordered):
        _kl_bwd[(tc, B)](
            q,
            k,
            w,
            idx,
            cnt,
            p,
            lse,
            psum,
            grad,
            dq,
            *targets,
            dw,
            T,
            idx.shape[-1],
            DH**-0.5,
            1.0 / B,
            t0,
            tc,
            J=J,
            **_kl_meta(q, "kl bwd"),
            ORDERED=ordered,
        )

    _key_grads(kl_dk, idx, 1, [dk])
    return dq, dk.to(k.dtype), dw


class _IndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, idx, p):
        q, k, w = _kl_inputs(q, k, w)
        idx, p = idx.to(torch.int32).contiguous(), p.detach().float().contiguous()
        cnt = _counts(idx)
        loss, lse, psum = _kl_forward(q, k, w, idx, cnt, p)
        ctx.save_for_backward(q, k, w, idx, cnt, p, lse, psum)
        return loss.sum() / q.shape[0]

    @staticmethod
    def backward(ctx, grad):
        return *_kl_backward(*ctx.saved_tensors, grad), None, None


def indexer_kl_loss(
    q_BTJD: torch.Tensor, k_BSD: torch.Tensor, w_BTJ: torch.Tensor, idx_BTK: torch.Tensor, p_BTK: torch.Tensor
) -> torch.Tensor:
    _one_row_if_longer(q_BTJD, k_BSD)
    return _IndexerKL.apply(q_BTJD, k_BSD, w_BTJ, idx_BTK, p_BTK)
