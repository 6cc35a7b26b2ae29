"""RMSNorm and gated RMSNorm on CUDA: the reference's result and gradients with one read of each
row forward (x, and the gate) and one write, fp32 inside. Tiles of BR rows x the whole row.

Forward, per row, r = 1 / sqrt(mean(x^2) + eps), a = x r:
    rms_norm:       y = w round_x(a)        (r kept for the backward)
    gated_rms_norm: y = w a s,  s = sigmoid(g)
Backward, with da = dy w (gated: dy w s, and dg = dy w a s (1 - s)):
    dx = r (da - a mean(da a)),   dw = sum over rows of dy round_x(a)  (gated: dy a s)
each program takes every P-th tile of rows and writes its own partial dw (summed afterwards, no
atomics; none when the weight is frozen). The casts back to x's dtype pass gradients through as
autograd's do.

Legend: N rows (all dims but the last), D the last dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_kernels.dispatch import sms
from kiln_kernels.remake import save, saved


@triton.jit
def _fwd(x_ptr, g_ptr, w_ptr, y_ptr, r_ptr, N, D, eps, GATED: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    ok = (rows < N)[:, None] & (cols < D)[None, :]
    at = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)
    tl.store(r_ptr + rows, r, mask=rows < N)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    a = xf * r[:, None]
    if GATED:
        g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
        y = w * a * tl.sigmoid(g)
    else:
        y = w * a.to(x.dtype).to(tl.float32)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bwd(
    x_ptr,
    g_ptr,
    w_ptr,
    r_ptr,
    dy_ptr,
    dx_ptr,
    dg_ptr,
    dw_ptr,
    N,
    D,
    GATED: tl.constexpr,
    NEED_DW: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    p, P = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BD)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BD,), tl.float32)
    for tile in range(p, tl.cdiv(N, BR), P):
        rows = tile * BR + tl.arange(0, BR)
        ok = (rows < N)[:, None] & (cols < D)[None, :]
        at = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + at, mask=ok, other=0.0)
        r = tl.load(r_ptr + rows, mask=rows < N, other=0.0)[:, None]
        dy = tl.load(dy_ptr + at, mask=ok, other=0.0).to(tl.float32)
        a = x.to(tl.float32) * r
        if GATED:
            s = tl.sigmoid(tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32))
            da = dy * w * s
            tl.store(dg_ptr + at, (da * a * (1 - s)).to(dg_ptr.dtype.element_ty), mask=ok)
            if NEED_DW:
                dw += tl.sum(dy * a * s, 0)
        else:
            da = dy * w
            if NEED_DW:
                dw += tl.sum(dy * a.to(x.dtype).to(tl.float32), 0)
        dx = r * (da - a * (tl.sum(da * a, 1) / D)[:, None])
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=ok)
    if NEED_DW:
        tl.store(dw_ptr + p * D + cols, dw, mask=cols < D)


def _tile(D: int) -> dict:
    BD = triton.next_power_of_2(D)
    return {"BR": max(1, min(32, 4096 // BD)), "BD": BD, "num_warps": 8 if BD >= 4096 else 4}


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, w, eps: float, dtype: torch.dtype | None):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        N = x2.shape[0]
        gated = gate is not None
        g2 = gate.reshape(-1, D) if gated else x2
        dtype = dtype or (x.dtype if gated else torch.promote_types(w.dtype, x.dtype))
        y = torch.empty(x2.shape, device=x.device, dtype=dtype)
        r = torch.empty(N, device=x.device, dtype=torch.float32)
        tile = _tile(D)
        if N:
            _fwd[(triton.cdiv(N, tile["BR"]),)](x2, g2, w, y, r, N, D, eps, GATED=gated, **tile)
        save(ctx, x2, g2 if gated else None, w, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, w, r = saved(ctx)
        N, D = x2.shape
        gated, need_dw = g2 is not None, ctx.needs_input_grad[2]
        tile = _tile(D)
        P = max(1, min(triton.cdiv(N, tile["BR"]), 4 * sms(x2, vector=True)))  # no dot: vector cores on an NPU
        dx = torch.empty_like(x2)
        dg = torch.empty_like(g2) if gated else dx
        parts = torch.empty(P, D, device=x2.device, dtype=torch.float32) if need_dw else dx
        _bwd[(P,)](
            x2,
            g2 if gated else x2,
            w,
            r,
            dy.reshape(N, D).contiguous(),
            dx,
            dg,
            parts,
            N,
            D,
            GATED=gated,
            NEED_DW=need_dw,
            **tile,
        )
        dw = parts.sum(0).to(w.dtype) if need_dw else None
        return dx.view(ctx.shape), dg.view(ctx.shape) if gated else None, dw, None, None


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _Norm.apply(x.contiguous(), None, weight_D.contiguous(), eps, dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    return _Norm.apply(x.contiguous(), gate.contiguous(), weight_D.contiguous(), eps, None)
