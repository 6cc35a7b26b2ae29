"""KDA's short convolution with SiLU on CUDA: the reference's result and gradients on the
[B, T, C] layout as the projections give it (no transposes, no padded copy), fp32 inside.

Forward, per tile of tokens and channels: pre[t] = sum_j w[j] x[t - (W-1) + j] over the taps
inside the token's document, y = silu(pre). Backward: dpre[u] = dy[u] silu'(pre[u]) with pre
recomputed from x (W x W loads of one tile, from cache), dx[t] = sum_j w[j] dpre[t + (W-1) - j]
over the outputs u of t's own document, and, when the filter trains, each program's partial
dw[j] = sum_t dpre[t] x[t - (W-1) + j], summed afterwards (no atomics). Documents
(``cu_seqlens``) become each token's document start on the device: no host sync.

Legend: B rows, T tokens, C channels, W the filter's width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BT, BC = 32, 128  # a tile: tokens x channels


@triton.jit
def _pre(x_ptr, w_ptr, start_ptr, u, t_ok, c, c_ok, T, C, W: tl.constexpr, DOCS: tl.constexpr,
         BT: tl.constexpr, BC: tl.constexpr):
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
def _fwd(x_ptr, w_ptr, start_ptr, y_ptr, T, C, W: tl.constexpr, DOCS: tl.constexpr,
         BT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    x_ptr += b * T * C
    pre = _pre(x_ptr, w_ptr, start_ptr, t, t_ok, c, c_ok, T, C, W, DOCS, BT, BC)
    y = pre * tl.sigmoid(pre)
    tl.store(y_ptr + b * T * C + t[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _bwd(x_ptr, w_ptr, start_ptr, dy_ptr, dx_ptr, dw_ptr, T, C, W: tl.constexpr, DOCS: tl.constexpr,
         NEED_DW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    x_ptr += b * T * C
    dy_ptr += b * T * C
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
        pre = _pre(x_ptr, w_ptr, start_ptr, u, u_ok, c, c_ok, T, C, W, DOCS, BT, BC)
        sg = tl.sigmoid(pre)
        dy = tl.load(dy_ptr + u[:, None] * C + c[None, :], mask=u_ok[:, None] & c_ok[None, :], other=0.0)
        dpre = dy.to(tl.float32) * sg * (1 + pre * (1 - sg))
        wv = tl.load(w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)
        dx += dpre * wv[None, :]
        if NEED_DW:
            if j == W - 1:  # u = t: this tile's own outputs, against the inputs of every tap
                for i in tl.static_range(W):
                    src = t - (W - 1) + i
                    ok = t_ok & (src >= s)
                    xv = tl.load(x_ptr + src[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
                    part = tl.sum(dpre * xv.to(tl.float32), 0)
                    row = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
                    tl.store(dw_ptr + (row * C + c) * W + i, part, mask=c_ok)
    tl.store(dx_ptr + b * T * C + t[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


def _starts(cu_seqlens: torch.Tensor | None, T: int, device) -> torch.Tensor | None:
    """Each token's document start (int32, [T]), from the offsets, on the device."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = torch.searchsorted(cu, torch.arange(T, device=device), right=True) - 1
    return cu[doc.clamp_min(0)].to(torch.int32)


def _grid(B: int, T: int, C: int):
    return triton.cdiv(T, BT), triton.cdiv(C, BC), B


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, starts):
        B, T, C = x.shape
        y = torch.empty_like(x)
        docs = starts is not None
        _fwd[_grid(B, T, C)](x, w, starts if docs else x, y, T, C, W=w.shape[-1], DOCS=docs, BT=BT, BC=BC)
        ctx.save_for_backward(x, w, starts)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, starts = ctx.saved_tensors
        B, T, C = x.shape
        W, docs, need_dw = w.shape[-1], starts is not None, ctx.needs_input_grad[1]
        dx = torch.empty_like(x)
        grid = _grid(B, T, C)
        parts = torch.empty(B * grid[0], C, W, device=x.device, dtype=torch.float32) if need_dw else dx
        _bwd[grid](x, w, starts if docs else x, dy.contiguous(), dx, parts, T, C, W=W, DOCS=docs, NEED_DW=need_dw,
                   BT=BT, BC=BC)
        dw = parts.sum(0).view(C, 1, W).to(w.dtype) if need_dw else None
        return dx, dw, None


def short_conv(x_BTC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, C] in the autocast dtype (x's dtype without autocast), as the reference's F.conv1d."""
    device = x_BTC.device.type
    dt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_BTC.dtype
    x, w = x_BTC.to(dt).contiguous(), weight_C1W.to(dt).contiguous()
    with torch.autocast(device, enabled=False):
        return _ShortConv.apply(x, w, _starts(cu_seqlens, x.shape[1], x.device))
