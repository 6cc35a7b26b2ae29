"""KDA's short convolution with SiLU (and q's and k's L2 norm per head) on CUDA: the reference's
result and gradients on the [B, T, C] layout as the projections give it (no transposes, no padded
copy), fp32 inside.

Forward, per tile of tokens and channels: pre[t] = sum_j w[j] x[t - (W-1) + j] over the taps
inside the token's document, s = silu(pre); with ``head_norm`` = n a tile is one group of n
channels and y = s r, r = 1 / sqrt(sum s^2 + eps), else y = s. Backward in two passes: ``_dpre``,
ds[u] = r (dy - y (y . dy)) (= dy without the norm), dpre[u] = ds[u] silu'(pre[u]) with pre
recomputed from x, into a buffer of x's size; ``_dx``, dx[t] = sum_j w[j] dpre[t + (W-1) - j]
over the outputs u of t's own document and, when the filter trains, each program's partial
dw[j] = sum_t dpre[t] x[t - (W-1) + j], summed afterwards (no atomics). (One pass recomputing
pre at each of the W outputs a token feeds read x W x W times: ~10x the memory floor.) Documents
(``cu_seqlens``, on the host or the device) become each token's document start on the device: no
host sync.

Legend: B rows, T tokens, C channels, W the filter's width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_kernels.conv.reference import EPS
from kiln_kernels.dispatch import document_table, to_device

BT, BC = 32, 128  # a tile: tokens x channels (with the norm: x one group, padded to a power of 2)


@triton.jit
def _pre(
    x_ptr,
    w_ptr,
    start_ptr,
    u,
    t_ok,
    c,
    c_ok,
    C,
    W: tl.constexpr,
    DOCS: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """pre[u] for the tile's tokens u (fp32): the taps before u's document start are zero."""
    if DOCS:
        s = tl.load(start_ptr + u, mask=t_ok, other=0)
    else:
        s = tl.zeros((BT,), tl.int32)
    acc = tl.zeros((BT, BC), tl.float32)
    for j in tl.static_range(W):
        src = u - (W - 1) + j
        ok = t_ok & (src >= s)
        xv = tl.load(x_ptr + src[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        wv = tl.load(w_ptr + c * W + j, mask=c_ok, other=0.0)
        acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    return acc


@triton.jit
def _channels(CH: tl.constexpr, BC: tl.constexpr, C):
    """The tile's channels: CH of them (a group, or BC), padded to BC."""
    i = tl.arange(0, BC)
    c = tl.program_id(1) * CH + i
    return c, (i < CH) & (c < C)


@triton.jit
def _fwd(
    x_ptr,
    w_ptr,
    start_ptr,
    y_ptr,
    T,
    C,
    eps,
    W: tl.constexpr,
    DOCS: tl.constexpr,
    NORM: tl.constexpr,
    CH: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c, c_ok = _channels(CH, BC, C)
    t_ok = t < T
    x_ptr += b * T * C
    pre = _pre(x_ptr, w_ptr, start_ptr, t, t_ok, c, c_ok, C, W, DOCS, BT, BC)
    y = pre * tl.sigmoid(pre)  # zero in the padding: its x and w load as zero
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, 1) + eps)[:, None]
    tl.store(
        y_ptr + b * T * C + t[:, None] * C + c[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _dpre(
    x_ptr,
    w_ptr,
    start_ptr,
    dy_ptr,
    dpre_ptr,
    T,
    C,
    eps,
    W: tl.constexpr,
    DOCS: tl.constexpr,
    NORM: tl.constexpr,
    CH: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """dpre for a tile of outputs u: pre recomputed from x (W loads), through silu and the norm."""
    b = tl.program_id(2).to(tl.int64)
    u = tl.program_id(0) * BT + tl.arange(0, BT)
    c, c_ok = _channels(CH, BC, C)
    u_ok = u < T
    pre = _pre(x_ptr + b * T * C, w_ptr, start_ptr, u, u_ok, c, c_ok, C, W, DOCS, BT, BC)
    sg = tl.sigmoid(pre)
    at = b * T * C + u[:, None] * C + c[None, :]
    ds = tl.load(dy_ptr + at, mask=u_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    if NORM:
        act = pre * sg
        r = tl.rsqrt(tl.sum(act * act, 1) + eps)
        y = act * r[:, None]
        ds = (ds - y * tl.sum(y * ds, 1)[:, None]) * r[:, None]
    tl.store(
        dpre_ptr + at,
        (ds * sg * (1 + pre * (1 - sg))).to(dpre_ptr.dtype.element_ty),
        mask=u_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _dx(
    x_ptr,
    w_ptr,
    start_ptr,
    dpre_ptr,
    dx_ptr,
    dw_ptr,
    T,
    C,
    W: tl.constexpr,
    DOCS: tl.constexpr,
    NEED_DW: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """dx for a tile of inputs t from the outputs of its document that read it; with NEED_DW, the
    tile's partial dw from its own outputs."""
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = c < C
    t_ok = t < T
    x_ptr += b * T * C
    dpre_ptr += b * T * C
    if DOCS:
        s = tl.load(start_ptr + t, mask=t_ok, other=0)
    else:
        s = tl.zeros((BT,), tl.int32)
    dx = tl.zeros((BT, BC), tl.float32)
    for j in tl.static_range(W):  # x[t] feeds output u = t + (W-1) - j through tap j
        u = t + (W - 1) - j
        u_ok = t_ok & (u < T)
        if DOCS:
            u_ok = u_ok & (tl.load(start_ptr + u, mask=u_ok, other=-1) == s)
        dp = tl.load(dpre_ptr + u[:, None] * C + c[None, :], mask=u_ok[:, None] & c_ok[None, :], other=0.0)
        dx += dp.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if NEED_DW:  # this tile's own outputs u = t, against the inputs of every tap
        dp = tl.load(dpre_ptr + t[:, None] * C + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        dp = dp.to(tl.float32)
        row = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        for i in tl.static_range(W):
            src = t - (W - 1) + i
            ok = t_ok & (src >= s)
            xv = tl.load(x_ptr + src[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            tl.store(dw_ptr + (row * C + c) * W + i, tl.sum(dp * xv.to(tl.float32), 0), mask=c_ok)
    tl.store(
        dx_ptr + b * T * C + t[:, None] * C + c[None, :],
        dx.to(dx_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )


def _starts(cu_seqlens: torch.Tensor | None, T: int, device) -> torch.Tensor | None:
    """Each token's document start (int32, [T]), from the offsets (on the host or the device),
    computed on the device."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.device.type != "cpu":
        return _make_starts(cu_seqlens, T, device)
    key = ("conv starts", tuple(cu_seqlens.tolist()), T, torch.device(device))
    return document_table(key, lambda: _make_starts(cu_seqlens, T, device))  # once for a step's layers


def _make_starts(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    cu = to_device(cu_seqlens.to(torch.int64), device)
    doc = torch.searchsorted(cu, torch.arange(T, device=device), right=True) - 1
    return cu[doc.clamp_min(0)].to(torch.int32)


def _tiles(B: int, T: int, C: int, head_norm: int) -> tuple[tuple[int, int, int], dict]:
    """The grid and the tile's sizes: one group of channels a tile with the norm, BC without."""
    CH = head_norm or BC
    return (triton.cdiv(T, BT), triton.cdiv(C, CH), B), {
        "NORM": bool(head_norm),
        "CH": CH,
        "BT": BT,
        "BC": triton.next_power_of_2(CH),
    }


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, starts, head_norm: int):
        B, T, C = x.shape
        y = torch.empty_like(x)
        docs = starts is not None
        grid, tile = _tiles(B, T, C, head_norm)
        _fwd[grid](x, w, starts if docs else x, y, T, C, EPS, W=w.shape[-1], DOCS=docs, **tile)
        ctx.save_for_backward(x, w, starts)
        ctx.head_norm = head_norm
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, starts = ctx.saved_tensors
        B, T, C = x.shape
        W, docs, need_dw = w.shape[-1], starts is not None, ctx.needs_input_grad[1]
        grid, tile = _tiles(B, T, C, ctx.head_norm)
        dpre = torch.empty_like(x)  # x's dtype: it rounds as dx does
        _dpre[grid](x, w, starts if docs else x, dy.contiguous(), dpre, T, C, EPS, W=W, DOCS=docs, **tile)
        dx = torch.empty_like(x)
        grid = (grid[0], triton.cdiv(C, BC), B)
        parts = torch.empty(B * grid[0], C, W, device=x.device, dtype=torch.float32) if need_dw else dx
        _dx[grid](x, w, starts if docs else x, dpre, dx, parts, T, C, W=W, DOCS=docs, NEED_DW=need_dw, BT=BT, BC=BC)
        dw = parts.sum(0).view(C, 1, W).to(w.dtype) if need_dw else None
        return dx, dw, None, None


def short_conv(
    x_BTC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor | None = None, head_norm: int = 0
) -> torch.Tensor:
    """[B, T, C] in the autocast dtype (x's dtype without autocast), as the reference's F.conv1d."""
    if head_norm and x_BTC.shape[-1] % head_norm:
        raise ValueError(f"head_norm {head_norm} does not divide the {x_BTC.shape[-1]} channels")
    device = x_BTC.device.type
    dt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_BTC.dtype
    x, w = x_BTC.to(dt).contiguous(), weight_C1W.to(dt).contiguous()
    with torch.autocast(device, enabled=False):
        return _ShortConv.apply(x, w, _starts(cu_seqlens, x.shape[1], x.device), head_norm)
