"""KDA's decay gate on CUDA (``reference.kda_gate`` is the definition): one elementwise pass
forward and one backward. The reference's form, a chain of fp32 torch ops over the whole
[B, T, H, K] gate (add the bias, exp, softplus or sigmoid, multiply), wrote and read the gate's
fp32 size several times a layer (measured: bench/RESULTS.md, the fourteenth session's whole-step
section). Here the forward reads g_raw (the projection's dtype) and writes g (fp32); the backward
reads g_raw and dg and writes dg_raw, and, where A_log or dt_bias train (full training), the
per-element terms of their gradients, summed by torch.

The same gate inside KDA's chunk cumulative sum (``kda_chunk(..., gate=...)``: ``_gated_cumsum``
and ``_gated_cumsum_bwd``, launched by triton.py): the chunk kernels then keep g_raw for the
backward, not an fp32 g of twice its size, and no pass writes g at all.

    x = g_raw + dt_bias,  a = exp(A_log[h])
    default:      g = -a softplus(x)              dg/dx = -a sigmoid(x)          dg/dA_log = g
    lower bound:  g = lb sigmoid(a x), s = that   dg/dx = lb a s (1 - s)        dg/dA_log = x dg/dx

softplus as torch's (x above 20 is x). Legend: N = B * T tokens, H heads, K channels a head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_kernels.kda.tiles import _put, _rows, _tile

BLOCK = 1024


@triton.jit
def _decay(x, a, lb, SAFE: tl.constexpr):
    """g and dg/dx from x = g_raw + dt_bias (fp32) and a = exp(A_log)."""
    if SAFE:
        s = tl.sigmoid(a * x)
        g = lb * s
        slope = lb * a * s * (1 - s)
    else:
        sp = tl.where(x > 20.0, x, tl.log(1 + tl.exp(tl.minimum(x, 20.0))))
        g = -a * sp
        slope = -a * tl.sigmoid(x)
    return g, slope


@triton.jit
def _gate_terms(x_ptr, a_ptr, bias_ptr, offs, ok, HK, K, lb, HAS_BIAS: tl.constexpr, SAFE: tl.constexpr):
    """x (fp32, with the bias), g and dg/dx at flat offsets."""
    col = offs % HK
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_ptr + col // K, mask=ok, other=0.0).to(tl.float32))
    g, slope = _decay(x, a, lb, SAFE)
    return x, g, slope


@triton.jit
def _fwd(
    x_ptr, a_ptr, bias_ptr, g_ptr, total, HK, K, lb, HAS_BIAS: tl.constexpr, SAFE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    _, g, _ = _gate_terms(x_ptr, a_ptr, bias_ptr, offs, ok, HK, K, lb, HAS_BIAS, SAFE)
    tl.store(g_ptr + offs, g, mask=ok)


@triton.jit
def _bwd(
    x_ptr,
    a_ptr,
    bias_ptr,
    dg_ptr,
    dx_ptr,
    da_ptr,
    total,
    HK,
    K,
    lb,
    HAS_BIAS: tl.constexpr,
    SAFE: tl.constexpr,
    NEED_DA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    x, g, slope = _gate_terms(x_ptr, a_ptr, bias_ptr, offs, ok, HK, K, lb, HAS_BIAS, SAFE)
    dg = tl.load(dg_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dx = dg * slope
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=ok)
    if NEED_DA:
        if SAFE:
            tl.store(da_ptr + offs, dx * x, mask=ok)
        else:
            tl.store(da_ptr + offs, dg * g, mask=ok)


@triton.jit
def _gated_tile(RAW, A, BIAS, rows, ok, h, H, K, lb, BK: tl.constexpr, HAS_BIAS: tl.constexpr, SAFE: tl.constexpr):
    """A chunk's rows of head h: x = g_raw + dt_bias, g (0 outside the rows) and dg/dx, fp32 [C, BK]."""
    x = _tile(RAW, rows, ok, h, H, K, BK)
    d = tl.arange(0, BK)
    if HAS_BIAS:
        x += tl.load(BIAS + h * K + d, mask=d < K, other=0.0).to(tl.float32)[None, :]
    g, slope = _decay(x, tl.exp(tl.load(A + h).to(tl.float32)), lb, SAFE)
    return x, tl.where(ok[:, None] & (d[None, :] < K), g, 0.0), slope


@triton.jit
def _gated_cumsum(RAW, A, BIAS, G, CHUNKS, H, K, lb, BK: tl.constexpr, HAS_BIAS: tl.constexpr, SAFE: tl.constexpr):
    """Gamma = the chunk-local cumulative sum of the decay, made from the gate's raw projection
    (kiln_kernels/kda/triton.py's ``_cumsum`` with the gate inside: g never in memory)."""
    c, h = tl.program_id(0), tl.program_id(1)
    _, rows, ok, _ = _rows(CHUNKS, c)
    _, g, _ = _gated_tile(RAW, A, BIAS, rows, ok, h, H, K, lb, BK, HAS_BIAS, SAFE)
    _put(G, tl.cumsum(g, 0), rows, ok, h, H, K, BK)


@triton.jit
def _gated_cumsum_bwd(
    DGAMMA,
    RAW,
    A,
    BIAS,
    DX,
    DA,
    CHUNKS,
    H,
    K,
    lb,
    BK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SAFE: tl.constexpr,
    NEED_DA: tl.constexpr,
):
    """dg = the reverse chunk-local cumulative sum of dGamma, then through the gate: d g_raw (and
    the per-element terms of A_log's gradient), as ``_bwd`` makes them."""
    c, h = tl.program_id(0), tl.program_id(1)
    _, rows, ok, _ = _rows(CHUNKS, c)
    dg = tl.cumsum(_tile(DGAMMA, rows, ok, h, H, K, BK), 0, reverse=True)
    x, g, slope = _gated_tile(RAW, A, BIAS, rows, ok, h, H, K, lb, BK, HAS_BIAS, SAFE)
    dx = dg * slope
    _put(DX, dx, rows, ok, h, H, K, BK)
    if NEED_DA:
        if SAFE:
            _put(DA, dx * x, rows, ok, h, H, K, BK)
        else:
            _put(DA, dg * g, rows, ok, h, H, K, BK)


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g_raw, A_log, dt_bias, lower_bound):
        H, K = g_raw.shape[-2:]
        x = g_raw.contiguous()
        g = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        total = x.numel()
        safe = lower_bound is not None
        _fwd[(triton.cdiv(total, BLOCK),)](
            x,
            A_log,
            dt_bias if dt_bias is not None else A_log,
            g,
            total,
            H * K,
            K,
            float(lower_bound or 0.0),
            HAS_BIAS=dt_bias is not None,
            SAFE=safe,
            BLOCK=BLOCK,
        )
        ctx.save_for_backward(x, A_log, dt_bias)
        ctx.lower_bound = lower_bound
        return g

    @staticmethod
    def backward(ctx, dg):
        x, A_log, dt_bias = ctx.saved_tensors
        H, K = x.shape[-2:]
        need_da, need_bias = ctx.needs_input_grad[1], dt_bias is not None and ctx.needs_input_grad[2]
        total = x.numel()
        dx = torch.empty_like(x)
        da = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_da else dx
        if need_bias:  # its gradient is summed from dx: keep dx in fp32 until then
            dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        _bwd[(triton.cdiv(total, BLOCK),)](
            x,
            A_log,
            dt_bias if dt_bias is not None else A_log,
            dg.contiguous(),
            dx,
            da,
            total,
            H * K,
            K,
            float(ctx.lower_bound or 0.0),
            HAS_BIAS=dt_bias is not None,
            SAFE=ctx.lower_bound is not None,
            NEED_DA=need_da,
            BLOCK=BLOCK,
        )
        d_bias = dx.reshape(-1, H, K).sum(0).to(dt_bias.dtype) if need_bias else None
        d_a = da.reshape(-1, H, K).sum((0, 2)).to(A_log.dtype) if need_da else None
        return dx.to(x.dtype), d_a, d_bias, None


def kda_gate(
    g_raw_BTHK: torch.Tensor,
    A_log_H: torch.Tensor,
    dt_bias_HK: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """``reference.kda_gate`` on CUDA: g [B, T, H, K] in fp32."""
    H, K = g_raw_BTHK.shape[-2:]
    bias = dt_bias_HK.reshape(H, K).contiguous() if dt_bias_HK is not None else None
    return _Gate.apply(g_raw_BTHK, A_log_H.reshape(H).contiguous(), bias, lower_bound)
