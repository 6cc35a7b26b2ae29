"""KDA (Kimi Delta Attention): the gated delta rule with a per-channel decay. The reference.

Per head, a state S in R^{K x V} (fp32). Step t, with q_t scaled by ``scale`` (K^-1/2 default):

    S  <- Diag(exp(g_t)) S                       decay, per key channel
    S  <- S + beta_t k_t (v_t - S^T k_t)^T       delta-rule write
    o_t = S^T q_t

Two forms with one signature: ``kda_recurrent`` (the definition, a loop over tokens) and
``kda_chunk`` (the training form: within a chunk of C tokens, the writes are solved at once by a
unit lower-triangular system; see shared/MODEL_NOTES.md). Both take variable-length batches as
``cu_seqlens`` (B == 1, sequences packed back to back, the state starting afresh at each
sequence: packed documents never see each other), an optional initial state per sequence, and
return the final state per sequence.

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, C chunk.
Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay, <= 0; with ``kda_chunk``'s
``gate``, the gate's raw projection); beta [B, T, H];
initial_state [N, H, K, V]; returns o [B, T, H, V] in v's dtype (the math in fp32, or fp64 for
fp64 inputs) and the final state [N, H, K, V] (fp32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kiln_kernels.widths import cast, wide_dtype


class Gate(NamedTuple):
    """The decay gate's parameters (``kda_gate``'s arguments after g_raw). Passed to ``kda_chunk``,
    they make its g the gate's raw projection: the decay is ``kda_gate(g, *gate)``, which the
    Triton form makes inside its kernels instead of holding it in fp32 (fla-core calls this
    ``use_gate_in_kernel``)."""

    A_log_H: torch.Tensor
    dt_bias_HK: torch.Tensor | None = None
    lower_bound: float | None = None


def kda_gate(
    g_raw_BTHK: torch.Tensor,
    A_log_H: torch.Tensor,
    dt_bias_HK: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Log-space decay from the gate projection, in fp32.
    Default: g = -exp(A_log) * softplus(g_raw + dt_bias). With ``lower_bound`` (K3's "safe
    gate", -5): g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias)), so g >= lower_bound."""
    H, K = g_raw_BTHK.shape[-2:]
    up = wide_dtype(g_raw_BTHK.dtype)  # fp32, or fp64 when checking
    x = cast(g_raw_BTHK, up)
    if dt_bias_HK is not None:
        x = x + cast(dt_bias_HK, up).view(H, K)
    a = cast(A_log_H, up).view(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def segments(T: int, cu_seqlens: torch.Tensor | None, B: int) -> list[tuple[int, int]]:
    """Each sequence's [start, end) along T: all of T without ``cu_seqlens``; checks them (B == 1,
    rising from 0 to T). The Triton form cuts its chunks by the same rule."""
    if cu_seqlens is None:
        return [(0, T)]
    if B != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into a batch of 1, got B={B}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
    return list(zip(cu, cu[1:], strict=False))


def _start_state(initial_state, n, varlen, shape, dtype, device) -> torch.Tensor:
    """The state a segment starts from: zeros, the batch's own states [B, H, K, V], or in
    variable-length mode sequence n's state."""
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return (initial_state[n : n + 1] if varlen else initial_state).to(dtype).clone()


def _prepare(q, k, v, g, beta, scale):
    """fp32 math (fp64 when given fp64, for checking others against it); q takes the scale."""
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    return dtype, (q.to(dtype) * scale, k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype))


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    out = v.dtype
    dtype, (q, k, v, g, beta) = _prepare(q, k, v, g, beta, scale)
    outs, finals = [], []
    for n, (a, b) in enumerate(segments(T, cu_seqlens, B)):
        S_BHKV = _start_state(initial_state, n, cu_seqlens is not None, (B, H, K, V), dtype, q.device)
        for t in range(a, b):
            S_BHKV = S_BHKV * g[:, t].exp()[..., None]
            err_BHV = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S_BHKV)
            S_BHKV = S_BHKV + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], err_BHV)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S_BHKV))
        finals.append(S_BHKV)
    o = torch.stack(outs, 1) if outs else torch.zeros(B, 0, H, V, dtype=dtype, device=q.device)
    return o.to(out), torch.cat(finals) if cu_seqlens is not None else finals[0]


def kda_step(
    q_NHK: torch.Tensor,
    k_NHK: torch.Tensor,
    v_NHV: torch.Tensor,
    g_NHK: torch.Tensor,
    beta_NH: torch.Tensor,
    state_NHKV: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_recurrent``'s step for N sequences at one token each, from their states: the same
    sums as a few batched products (a decoder's step, where the loop's einsums cost more than
    their arithmetic). Returns o [N, H, V] in v's dtype and the states [N, H, K, V] (fp32: autocast
    off inside, which would take the state's update to bf16)."""
    if torch.is_autocast_enabled(q_NHK.device.type):
        with torch.autocast(q_NHK.device.type, enabled=False):
            return kda_step(q_NHK, k_NHK, v_NHV, g_NHK, beta_NH, state_NHKV, scale)
    N, H, K = q_NHK.shape
    V = v_NHV.shape[-1]
    up = wide_dtype(state_NHKV.dtype)
    scale = K**-0.5 if scale is None else scale
    S = cast(state_NHKV, up).reshape(N * H, K, V) * cast(g_NHK, up).exp().reshape(N * H, K, 1)
    k = cast(k_NHK, up).reshape(N * H, 1, K)
    err = cast(v_NHV, up).reshape(N * H, 1, V) - torch.bmm(k, S)
    # the write is rank one: an elementwise product (a batched GEMM of inner size 1 costs the CPU
    # eight times as much)
    S = torch.addcmul(S, k.transpose(1, 2), err * cast(beta_NH, up).reshape(N * H, 1, 1))
    o = torch.bmm(cast(q_NHK, up).reshape(N * H, 1, K) * scale, S)
    return cast(o.view(N, H, V), v_NHV.dtype), S.view(N, H, K, V)


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    gate: Gate | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if gate is not None:
        g = kda_gate(g, *gate)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out = v.dtype
    dtype, (q, k, v, g, beta) = _prepare(q, k, v, g, beta, scale)
    C = chunk_size
    outs, finals = [], []
    for n, (a, b) in enumerate(segments(T, cu_seqlens, B)):
        L = b - a
        pad = (-L) % C  # pad tokens: no decay (g=0), no write (beta=0, k=0): S passes unchanged

        def chunks(x, fill=0.0):
            x = x[:, a:b]
            if pad:
                x = torch.cat([x, x.new_full((B, pad, *x.shape[2:]), fill)], 1)
            return x.reshape(B, -1, C, *x.shape[2:]).transpose(2, 3).transpose(1, 2)  # B H NC C ...

        q_c, k_c, v_c, g_c = chunks(q), chunks(k), chunks(v), chunks(g)  # [B, H, NC, C, K|V]
        b_c = chunks(beta[..., None])[..., 0]  # [B, H, NC, C]
        G = g_c.cumsum(-2)  # Gamma: decay from the chunk start, per channel
        diff = G[..., :, None, :] - G[..., None, :, :]  # [.., C(i), C(j), K]: Gamma_i - Gamma_j
        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # exp only where j <= i (there Gamma_i - Gamma_j <= 0): no overflow above the diagonal
        decay = torch.where(incl[..., None], diff, torch.zeros_like(diff)).exp()
        A_kk = torch.einsum("...id,...jd,...ijd->...ij", k_c, k_c, decay) * b_c[..., None]
        A_kk = A_kk.masked_fill(~strict, 0.0)
        A_qk = torch.einsum("...id,...jd,...ijd->...ij", q_c, k_c, decay).masked_fill(~incl, 0.0)
        eye = torch.eye(C, dtype=dtype, device=q.device)
        # T = (I + A_kk)^-1 diag(beta): forward substitution on a unit lower-triangular matrix
        Tm = torch.linalg.solve_triangular(eye + A_kk, torch.diag_embed(b_c), upper=False, unitriangular=True)
        W = Tm @ (G.exp() * k_c)  # [B, H, NC, C, K]
        U = Tm @ v_c  # [B, H, NC, C, V]
        S = _start_state(initial_state, n, cu_seqlens is not None, (B, H, K, V), dtype, q.device)
        o_c = []
        for c in range(q_c.shape[2]):
            Vn = U[:, :, c] - W[:, :, c] @ S  # the writes' residuals against the state at the chunk start
            o_c.append((q_c[:, :, c] * G[:, :, c].exp()) @ S + A_qk[:, :, c] @ Vn)
            last = G[:, :, c, -1]  # [B, H, K]
            S = (
                last.exp()[..., None] * S
                + ((last[:, :, None, :] - G[:, :, c]).exp() * k_c[:, :, c]).transpose(-1, -2) @ Vn
            )
        if o_c:  # an empty sequence has no chunks: no output, its state passes through
            outs.append(torch.stack(o_c, 2).permute(0, 2, 3, 1, 4).reshape(B, -1, H, V)[:, :L])  # B NC C H V -> B L H V
        finals.append(S)
    o = torch.cat(outs, 1) if outs else q.new_zeros(B, 0, H, V)
    return o.to(out), torch.cat(finals) if cu_seqlens is not None else finals[0]
