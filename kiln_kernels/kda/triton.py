"""KDA's chunked form in Triton, forward and backward; the signature of ``reference.kda_chunk``.
This file holds the plan and the host side; the kernels are in chunk_fwd.py and chunk_bwd.py,
their shared tile helpers in tiles.py.

Sequences (``cu_seqlens``, or the batch's rows) are cut into chunks of C = 64 tokens that never
straddle two sequences. Per (chunk, head), with Gamma = cumsum(g) inside the chunk:

- forward: ``_cumsum`` (Gamma), ``_intra`` (A_qk, A_kk; a program per 16-row block), ``_solve``
  ((I + A_kk)^-1 by blocks), ``_wu`` (W, U, the decayed keys and queries), ``_states`` (the chunks
  in order per sequence and head: the state at each chunk's start, V' = U - W S), ``_output``
  (O = (Q e^Gamma) S + A_qk V');
- backward: A_qk and the inverse come from the forward; ``_cumsum``, ``_wu`` and ``_states`` again,
  ``_dstates`` (the chunks in reverse: dS at each chunk's end, dV'), ``_dlocal`` (every gradient
  that needs S, dS, V' or the inverse, and dA_qk, dA_kk), ``_dintra`` (the gradients through
  A_qk and A_kk; a program per 16-row block and 64 columns of K), then ``_cumsum`` reversed turns
  dGamma into dg. No atomics: deterministic;
- with ``gate`` (the model's form), g is the decay gate's raw projection: gate.py's
  ``_gated_cumsum`` makes the decay on its way into Gamma, and ``_gated_cumsum_bwd`` takes dGamma
  through the reverse cumsum and the gate to d g_raw, so the fp32 decay is never stored.

A_qk[i, j] = sum_d q_id k_jd e^(Gamma_id - Gamma_jd) (j <= i) has a decay per channel, so it is no
plain product. In blocks of 16 rows it is: for a row block X and an earlier block J, with r the
first row of X, (q_X e^(Gamma_X - Gamma_r)) (k_J e^(Gamma_r - Gamma_J))^T, both factors <= 1 as
g <= 0 (a product on the tensor cores, no overflow whatever the decay). Inside X the same split
has a factor e^(Gamma_r - Gamma_j) >= 1: a product where X's decay spans less than e^SPAN
(``_spanned``), else a loop over X's 16 tokens. A_kk is the same with beta_i k_i for q_i and j < i.

Legend as in reference.py; R = B * T rows. What only feeds products or sums at the inputs'
precision (A_qk, the inverse, W, U, V', dV', the chunk states, the output) is stored in the
inputs' dtype, the rest in fp32 (Gamma, the final state, dS, the gradients until their last
write); the products take their operands in the inputs' dtype (bf16 tensor cores for bf16
inputs, IEEE fp32 for fp32) and sum in fp32, except the inverse's (IEEE fp32), the diagonal
blocks' (fp32 operands: tf32 forward, IEEE backward) and ``_dintra``'s (tf32 for bf16 inputs):
there bf16 rounding does not cancel where dGamma's terms do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_kernels.dispatch import document_table, dot_precision, kept, to_device
from kiln_kernels.kda.chunk_bwd import _dintra, _dlocal, _dstates
from kiln_kernels.kda.chunk_fwd import _cumsum, _intra, _output, _solve, _states, _wu
from kiln_kernels.kda.gate import _gated_cumsum, _gated_cumsum_bwd
from kiln_kernels.kda.reference import Gate, segments
from kiln_kernels.kda.tiles import C
from kiln_kernels.remake import save, saved


def _chunks(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's [first row, end), and [N + 1, 2]: each sequence's first chunk and first row
    (then the totals); made once for a layout (``document_table``)."""
    return document_table(("kda chunks", tuple(cu), torch.device(device)), lambda: _make_chunks(cu, device))


def _make_chunks(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    spans, seq = [], [(0, 0)]
    for a, b in zip(cu, cu[1:], strict=False):
        spans += [(s, min(s + C, b)) for s in range(a, b, C)]
        seq.append((len(spans), b))
    return to_device(torch.tensor(spans or [(0, 0)], dtype=torch.int32).flatten(), device), to_device(
        torch.tensor(seq, dtype=torch.int32).flatten(), device
    )


# Launch settings per kernel: the fastest forward + backward of ``python3 -m bench.kda --tune`` at 32k
# tokens x 16 heads in documents of 8k, bf16, on the H200 (2026-12-05: the forward's kernels; the
# backward's kept, their sweep cut short). BV: the V block of the chunk-by-chunk kernels and
# _output, BW _wu's column block; BV at most 32 for fp32 inputs, whose tiles take twice the shared
# memory.
CONFIG: dict[str, dict[str, int]] = {
    "intra": dict(num_warps=2),
    "solve": dict(num_warps=1),
    "wu": dict(BW=64, num_warps=8),
    "states": dict(BV=32, num_stages=2),
    "output": dict(BV=128, num_warps=8),
    "dstates": dict(BV=64, num_stages=2),
    "dlocal": dict(BV=32, num_warps=8),
    "dintra": dict(num_warps=2),
}


class _Shapes:
    def __init__(self, q, v, chunks, seq):
        self.R, self.H, self.K = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        self.V = v.shape[-1]
        self.NC, self.N = chunks.numel() // 2, seq.numel() // 2 - 1
        self.BK, self.BV = triton.next_power_of_2(self.K), triton.next_power_of_2(self.V)
        self.wide = q.element_size() > 2
        self.BKS = min(self.BK, 64)  # K block of _dlocal and _dintra
        self.PREC = dot_precision(q)
        self.DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)
        # what only feeds products is stored in their operands' dtype (nothing is lost: they round it anyway)
        self.low = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
        # the decay a diagonal block may span and still be a product (see _spanned): e^80 and e^-80 are
        # finite and normal in fp32 and bf16, fp16 reaches e^11 only
        self.SPAN = 8.0 if q.dtype == torch.float16 else 80.0

    def launch(self, kernel: str) -> dict[str, int]:
        """CONFIG's settings of a kernel, its V block fitted to V and the inputs' dtype."""
        cfg = dict(CONFIG[kernel])
        if "BV" in cfg:
            cfg["BV"] = min(self.BV, cfg["BV"], 32 if self.wide else cfg["BV"])
        if "BW" in cfg:  # _wu's column block: K's and V's columns, no wider than the wider of them
            cfg["BW"] = min(max(self.BK, self.BV), cfg["BW"])
        return cfg


def _gamma_of(g, gate: Gate | None, chunks, s: _Shapes) -> torch.Tensor:
    """Gamma = cumsum(g) inside each chunk, fp32 (not saved: the backward computes it again); with
    ``gate``, g is the gate's raw projection and the decay is made on the way in."""
    G = g.new_empty(s.R, s.H, s.K, dtype=torch.float32)
    if gate is None:
        _cumsum[(s.NC, s.H)](g, G, chunks, s.H, s.K, BK=s.BK, REVERSE=False)
    else:
        A, bias, lb, meta = _gate_args(gate, s)
        _gated_cumsum[(s.NC, s.H)](g, A, bias, G, chunks, s.H, s.K, lb, **meta)
    return G


def _gate_args(gate: Gate, s: _Shapes) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
    """gate.py's chunk kernels' gate arguments: A_log, dt_bias (A_log where there is none: a
    pointer never read), the lower bound (0 where there is none) and their constexprs."""
    A, bias, lb = gate
    meta = dict(BK=s.BK, HAS_BIAS=bias is not None, SAFE=lb is not None)
    return A, A if bias is None else bias, float(lb or 0.0), meta


def _dg_of(dG, g, gate: Gate | None, chunks, s: _Shapes, need_A: bool, need_bias: bool):
    """dg from dGamma by a reverse cumsum inside each chunk; with ``gate``, through the gate too:
    d g_raw, and A_log's and dt_bias's gradients where they train."""
    if gate is None:
        dg = torch.empty_like(g)
        _cumsum[(s.NC, s.H)](dG, dg, chunks, s.H, s.K, BK=s.BK, REVERSE=True)
        return dg, None, None
    A, bias, lb, meta = _gate_args(gate, s)
    f32 = torch.float32
    dx = torch.empty(g.shape, dtype=f32 if need_bias else g.dtype, device=g.device)  # fp32 until summed
    da = torch.empty(g.shape, dtype=f32, device=g.device) if need_A else dx
    _gated_cumsum_bwd[(s.NC, s.H)](dG, g, A, bias, dx, da, chunks, s.H, s.K, lb, **meta, NEED_DA=need_A)
    d_A = da.view(-1, s.H, s.K).sum((0, 2)).to(A.dtype) if need_A else None
    d_bias = dx.view(-1, s.H, s.K).sum(0).to(bias.dtype) if need_bias else None
    return dx.to(g.dtype), d_A, d_bias


def _prepare(q, k, g, gate, beta, scale, chunks, s: _Shapes):
    """Gamma, A_qk and (I + A_kk)^-1 (saved for the backward)."""
    R, H, K = s.R, s.H, s.K
    G = _gamma_of(g, gate, chunks, s)
    Aqk = q.new_empty(R, H, C, dtype=s.low)
    Akk = q.new_empty(R, H, C, dtype=torch.float32)
    _intra[(s.NC * 4, H)](
        q, k, beta, G, Aqk, Akk, chunks, scale, H, K, BK=s.BK, DT=s.DT, PREC=s.PREC, SPAN=s.SPAN, **s.launch("intra")
    )
    Mi = q.new_empty(R, H, C, dtype=s.low)
    _solve[(s.NC, H)](Akk, Mi, chunks, H, **s.launch("solve"))
    return G, Aqk, Mi


def _recurrence(q, k, v, beta, G, Mi, h0, scale, chunks, seq, s: _Shapes):
    """W, the decayed keys and queries, the state at each chunk's start, V' = U - W S and the final state."""
    R, H, K, V = s.R, s.H, s.K, s.V
    W, KD, QG = (k.new_empty(R, H, K, dtype=s.low) for _ in range(3))
    U = k.new_empty(R, H, V, dtype=s.low)
    cfg = s.launch("wu")
    _wu[(s.NC, H, triton.cdiv(max(K, V), cfg["BW"]))](
        q,
        k,
        v,
        beta,
        G,
        Mi,
        W,
        U,
        KD,
        QG,
        chunks,
        scale,
        H,
        K,
        V,
        DT=s.DT,
        PREC=s.PREC,
        **cfg,
    )
    HS = k.new_empty(s.NC, H, K, V, dtype=s.low)
    VN = k.new_empty(R, H, V, dtype=s.low)
    HT = k.new_empty(s.N, H, K, V, dtype=torch.float32)
    cfg = s.launch("states")
    _states[(triton.cdiv(V, cfg["BV"]), s.N * H)](
        KD,
        W,
        U,
        G,
        h0 if h0 is not None else HT,
        HS,
        VN,
        HT,
        chunks,
        seq,
        H,
        K,
        V,
        BK=s.BK,
        HAS_H0=h0 is not None,
        DT=s.DT,
        PREC=s.PREC,
        **cfg,
    )
    return W, KD, QG, HS, VN, HT


class _KDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, cu, A_log, dt_bias, lower_bound):
        B, T, H, K = q.shape
        chunks, seq = _chunks(cu, q.device)
        s = _Shapes(q, v, chunks, seq)
        flat = [x.contiguous() for x in (q, k, v, g, beta)]
        q, k, v, g, beta = flat
        ctx.h0_dtype = h0.dtype if h0 is not None else None
        h0 = h0.float().contiguous() if h0 is not None else None
        gate = None if A_log is None else Gate(A_log, dt_bias, lower_bound)

        def run():
            G, Aqk, Mi = _prepare(q, k, g, gate, beta, scale, chunks, s)
            W, KD, QG, HS, VN, HT = _recurrence(q, k, v, beta, G, Mi, h0, scale, chunks, seq, s)
            del G, W, KD  # dead: the output takes their memory (Gamma and KD: 384 MiB at 32k x 16)
            o = torch.empty(B, T, H, s.V, device=q.device, dtype=v.dtype)
            cfg = s.launch("output")
            _output[(s.NC, H, triton.cdiv(s.V, cfg["BV"]))](
                QG, Aqk, HS, VN, o, chunks, H, K, s.V, BK=s.BK, DT=s.DT, PREC=s.PREC, **cfg
            )
            return o, HT, Aqk, Mi

        o, HT, Aqk, Mi = kept("kda", run)  # all the backward saves but the inputs
        save(ctx, *flat, h0 if h0 is not None else HT.new_empty(0), chunks, seq, Aqk, Mi, A_log, dt_bias)
        ctx.scale, ctx.s, ctx.has_h0, ctx.lower_bound = scale, s, h0 is not None, lower_bound
        return o, HT

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, chunks, seq, Aqk, Mi, A_log, dt_bias = saved(ctx)
        s, scale = ctx.s, ctx.scale
        h0 = h0 if ctx.has_h0 else None
        gate = None if A_log is None else Gate(A_log, dt_bias, ctx.lower_bound)
        R, H, K, V, NC, N = s.R, s.H, s.K, s.V, s.NC, s.N
        G = _gamma_of(g, gate, chunks, s)
        W, KD, QG, HS, VN, _ = _recurrence(q, k, v, beta, G, Mi, h0, scale, chunks, seq, s)
        do = do.contiguous()
        f32 = torch.float32
        DH = torch.empty_like(HS, dtype=f32)
        DVN = q.new_empty(R, H, V, dtype=s.low)
        DH0 = q.new_empty(N, H, K, V, dtype=f32)
        cfg = s.launch("dstates")
        _dstates[(triton.cdiv(V, cfg["BV"]), N * H)](
            QG,
            KD,
            G,
            W,
            Aqk,
            do,
            dht.float().contiguous() if dht is not None else DH0,
            DH,
            DVN,
            DH0,
            chunks,
            seq,
            H,
            K,
            V,
            BK=s.BK,
            HAS_DHT=dht is not None,
            DT=s.DT,
            PREC=s.PREC,
            **cfg,
        )
        del W, KD, QG  # each buffer dead is memory the gradients below take (a backward's peak)
        dq, dk, dG = (q.new_empty(R, H, K, dtype=f32) for _ in range(3))
        dv = torch.empty_like(v)
        db = q.new_empty(R, H, dtype=f32)
        dAqk, dAkk = q.new_empty(R, H, C, dtype=f32), q.new_empty(R, H, C, dtype=f32)
        _dlocal[(NC, H)](
            q,
            k,
            v,
            beta,
            G,
            Mi,
            VN,
            DVN,
            do,
            HS,
            DH,
            dq,
            dk,
            dv,
            db,
            dG,
            dAqk,
            dAkk,
            chunks,
            scale,
            H,
            K,
            V,
            BK=s.BKS,
            DT=s.DT,
            PREC=s.PREC,
            **s.launch("dlocal"),
        )
        del HS, VN, DH, DVN
        NKB = triton.cdiv(K, s.BKS)
        dbp = q.new_empty(NKB, R, H, dtype=f32)
        dqo, dko = torch.empty_like(q), torch.empty_like(k)
        # fp32 operands (tf32 for bf16 inputs): dGamma's terms cancel in sums over the chunk (A depends on
        # Gamma_i - Gamma_j only), bf16 products leave a residue that dg's reverse cumsum carries along
        _dintra[(NC * 4, H, NKB)](
            q,
            k,
            beta,
            G,
            dAqk,
            dAkk,
            dq,
            dk,
            dbp,
            dG,
            dqo,
            dko,
            chunks,
            scale,
            R,
            H,
            K,
            BK=s.BKS,
            DT=tl.float32,
            PREC=s.PREC,
            SPAN=s.SPAN,
            **s.launch("dintra"),
        )
        db += dbp.sum(0)
        need_A, need_bias = ctx.needs_input_grad[8], ctx.needs_input_grad[9]
        dg, d_A, d_bias = _dg_of(dG, g, gate, chunks, s, need_A, need_bias)
        return (
            dqo,
            dko,
            dv,
            dg,
            db.view(beta.shape).to(beta.dtype),
            None,
            DH0.to(ctx.h0_dtype) if ctx.has_h0 else None,
            None,
            d_A,
            d_bias,
            None,
        )


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
    """``reference.kda_chunk`` in Triton (chunks of 64 whatever ``chunk_size`` says: the chunk
    size changes the order of the sums, not the result). o in v's dtype, the final state in fp32.
    With ``gate`` the decay is made from g inside the chunk cumulative sum (gate.py)."""
    B, T, H, K = q.shape
    if cu_seqlens is None:  # each row a sequence
        cu = list(range(0, B * T + 1, T)) if T else [0] * (B + 1)
    else:
        cu = [a for a, _ in segments(T, cu_seqlens, B)] + [T]  # checked as the reference checks them
    scale = K**-0.5 if scale is None else scale
    A_log = dt_bias = lower_bound = None
    if gate is not None:
        A_log, lower_bound = gate.A_log_H.reshape(H).contiguous(), gate.lower_bound
        dt_bias = None if gate.dt_bias_HK is None else gate.dt_bias_HK.reshape(H, K).contiguous()
    return _KDA.apply(q, k, v, g, beta, scale, initial_state, cu, A_log, dt_bias, lower_bound)
