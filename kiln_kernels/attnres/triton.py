"""Depth attention (AttnRes) on CUDA: the reference's result and gradients in two kernels that
read each source row once a pass and keep everything else in registers.

Per token, with sources v_i (i < L), the pseudo-query w and r_i = rsqrt(mean(v_i^2) + eps):
    s_i = r_i (w . v_i),   alpha = softmax(s),   h = sum_i alpha_i v_i
Forward: one pass over the sources with an online softmax (running max, sum and weighted sum);
the row's logsumexp is kept for the backward. Backward, with c = sum_i alpha_i (dh . v_i):
    ds_i = alpha_i (dh . v_i - c)
    dv_i = alpha_i dh + ds_i r_i (w - (w . v_i) r_i^2 v_i / D)
    dw   = sum over tokens and sources of ds_i r_i v_i
two passes over the sources (c first); each program takes a run of rows and writes its own
partial dw, summed afterwards (no atomics). fp32 inside for any input dtype.

Legend: L sources, N = B * T tokens, D hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_kernels.dispatch import sms


@triton.jit
def _fwd(v_ptr, w_ptr, h_ptr, lse_ptr, L, N, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for i in range(L):
        v = tl.load(v_ptr + (i * N + row) * D + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(v * v, 0) / D + eps)
        s = r * tl.sum(v * w, 0)
        m_new = tl.maximum(m, s)
        scale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l = l * scale + p
        acc = acc * scale + p * v
        m = m_new
    tl.store(h_ptr + row * D + cols, (acc / l).to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + row, m + tl.log(l))


@triton.jit
def _bwd(v_ptr, w_ptr, dh_ptr, lse_ptr, dv_ptr, dw_ptr, L, N, D, eps, ROWS, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    for k in range(ROWS):
        row = (pid * ROWS + k).to(tl.int64)
        if row < N:
            dh = tl.load(dh_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            lse = tl.load(lse_ptr + row)
            c = tl.zeros((), tl.float32)
            for i in range(L):
                v = tl.load(v_ptr + (i * N + row) * D + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.rsqrt(tl.sum(v * v, 0) / D + eps)
                a = tl.exp(r * tl.sum(v * w, 0) - lse)
                c += a * tl.sum(dh * v, 0)
            for i in range(L):
                v = tl.load(v_ptr + (i * N + row) * D + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.rsqrt(tl.sum(v * v, 0) / D + eps)
                wv = tl.sum(v * w, 0)
                a = tl.exp(r * wv - lse)
                ds = a * (tl.sum(dh * v, 0) - c)
                dv = a * dh + ds * r * (w - wv * r * r * v / D)
                tl.store(dv_ptr + (i * N + row) * D + cols, dv.to(dv_ptr.dtype.element_ty), mask=mask)
                dw += ds * r * v
    tl.store(dw_ptr + pid * D + cols, dw, mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


class _DepthAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sources_LBTD, w_D, eps):
        L, D = sources_LBTD.shape[0], sources_LBTD.shape[-1]
        v = sources_LBTD.contiguous().view(L, -1, D)
        N = v.shape[1]
        h = torch.empty((N, D), dtype=sources_LBTD.dtype, device=v.device)
        lse = torch.empty(N, dtype=torch.float32, device=v.device)
        block = triton.next_power_of_2(D)
        if N:
            _fwd[(N,)](v, w_D.contiguous(), h, lse, L, N, D, eps, BLOCK_D=block, num_warps=_warps(block))
        ctx.save_for_backward(v, w_D, lse)
        ctx.eps, ctx.shape = eps, sources_LBTD.shape
        return h.view(sources_LBTD.shape[1:])

    @staticmethod
    def backward(ctx, dh):
        v, w_D, lse = ctx.saved_tensors
        L, N, D = v.shape
        dv = torch.empty_like(v)
        programs = max(1, min(N, 4 * sms(v, vector=True)))  # no dot: vector cores on an NPU
        rows = -(-N // programs) if N else 1
        dw = torch.zeros((programs, D), dtype=torch.float32, device=v.device)
        block = triton.next_power_of_2(D)
        if N:
            _bwd[(programs,)](
                v,
                w_D.contiguous(),
                dh.contiguous().view(N, D),
                lse,
                dv,
                dw,
                L,
                N,
                D,
                ctx.eps,
                rows,
                BLOCK_D=block,
                num_warps=_warps(block),
            )
        return dv.view(ctx.shape), dw.sum(0).to(w_D.dtype), None


def depth_attention(sources_LBTD: torch.Tensor, w_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[B, T, D] in the sources' dtype; the softmax and the sum in fp32."""
    return _DepthAttention.apply(sources_LBTD, w_D, eps)
