"""Gated DSA at long sequences, forward + backward: the Triton path (kiln_kernels/dsa/triton.py)
against the PyTorch gather path (dense index scores and torch.topk, gathered keys, einsum, the
loss on gathered index keys: small unfused ops, run in query chunks so that they fit), and
against dense causal FlashAttention (torch SDPA) at the same length, in one run.

    python3 -m bench.dsa       # T = 8k..64k, top-k 2048, MLA absorbed: H 64, D 576, E 512, bf16

Parts, each forward + backward where it has one:
- top-k: the lightning indexer's scores (64 index heads of 128) and the top-k;
- attention: sparse attention over the selected keys with the indexer's target (the heads'
  averaged probabilities), gradients of q and of the shared key/value rows;
- loss: the indexer's KL loss, gradients of its q, k and weights;
- dense: SDPA causal attention in MLA's plain form (H heads of qk 192, v 128), no indexer.
TFLOP/s of the sparse attention count 2 T H K (D + E) forward and 2.5x that backward.
Median of 3 timed calls after 1. Writes bench/results/dsa.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.cuda_time import DEV, median_ms
from engine import device as accelerator
from kiln_kernels.dsa import triton as fused


def timed(fn) -> float:
    return median_ms(fn, reps=3, warmup=1)


def gather_topk(qi, ki, w, topk, chunk):
    """[T, K] by small ops: dots of every index head, ReLU, weighted sum, causal mask, topk."""
    T, J, Dh = qi.shape
    out = torch.full((T, min(topk, T)), -1, dtype=torch.int32, device=qi.device)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        dots = torch.einsum("tjd,sd->tjs", qi[c0:c1], ki[:c1]) * Dh**-0.5
        scores = torch.einsum("tj,tjs->ts", w[c0:c1].float(), F.relu(dots).float())
        t = torch.arange(c0, c1, device=qi.device)[:, None]
        scores = scores.masked_fill(torch.arange(c1, device=qi.device)[None] > t, float("-inf"))
        best = scores.topk(min(topk, c1), -1)
        out[c0:c1, : best.indices.shape[-1]] = torch.where(best.values > float("-inf"), best.indices, -1).int()
    return out


def gather_attention(q, kv, idx, do, E, scale, chunk):
    """Sparse attention by gathering the selected rows, forward and backward, query chunk by chunk
    (gradients accumulate in q.grad and kv.grad); returns the indexer's target."""
    targets = []
    for c0 in range(0, q.shape[0], chunk):
        c1 = min(q.shape[0], c0 + chunk)
        sel = idx[c0:c1].long()
        rows = kv[sel.clamp_min(0)]  # [C, K, D]
        s = torch.einsum("thd,tkd->thk", q[c0:c1], rows).float() * scale
        p = torch.softmax(s.masked_fill((sel < 0)[:, None], float("-inf")), -1)
        o = torch.einsum("thk,tke->the", p.to(q.dtype), rows[..., :E])
        o.backward(do[c0:c1])
        targets.append(p.detach().mean(1))
    return torch.cat(targets)


def gather_loss(qi, ki, w, idx, target, chunk):
    for c0 in range(0, qi.shape[0], chunk):
        c1 = min(qi.shape[0], c0 + chunk)
        sel = idx[c0:c1].long()
        dots = torch.einsum("tjd,tkd->tjk", qi[c0:c1], ki[sel.clamp_min(0)]) * qi.shape[-1] ** -0.5
        scores = torch.einsum("tj,tjk->tk", w[c0:c1].float(), F.relu(dots).float())
        log_q = torch.log_softmax(scores.masked_fill(sel < 0, float("-inf")), -1)
        p = target[c0:c1]
        kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p))
        kl.sum().backward()


CANDIDATES = {
    "fwd": [
        dict(BH=16, EB=512, BK=32, num_warps=4),
        dict(BH=32, EB=256, BK=32, num_warps=8),
        dict(BH=64, EB=128, BK=32, num_warps=8),
        dict(BH=64, EB=256, BK=32, num_warps=8),
        dict(BH=16, EB=512, BK=64, num_warps=8),
    ],
    "dq": [
        dict(BH=16, BK=32, num_warps=4),
        dict(BH=32, BK=32, num_warps=8),
        dict(BH=16, BK=64, num_warps=8),
        dict(BH=64, BK=16, num_warps=8),
    ],
    "dkv": [
        dict(BH=16, BK=16, num_warps=8),
        dict(BH=32, BK=16, num_warps=8),
        dict(BH=64, BK=16, num_warps=8),
        dict(BH=16, BK=32, num_warps=8),
        dict(BH=32, BK=32, num_warps=8),
    ],
    "weights": [dict(BH=16, BK=32, num_warps=4), dict(BH=64, BK=32, num_warps=8), dict(BH=32, BK=64, num_warps=8)],
}


def tune(a) -> None:
    """Each attention kernel's candidate block sizes at the first --seq, the others at their
    defaults: the time of the whole attention (forward, target, backward)."""
    T, H, D, E = a.seq[0], a.heads, 576, 512
    bf: dict[str, Any] = dict(device=DEV, dtype=torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, T, H, D, generator=g, **bf).requires_grad_()
    kv = torch.randn(1, T, 1, D, generator=g, **bf).requires_grad_()
    do = torch.randn(1, T, H, E, generator=g, **bf)
    idx = fused.indexer_topk(
        torch.randn(1, T, 8, 64, generator=g, **bf),
        torch.randn(1, T, 64, generator=g, **bf),
        torch.randn(1, T, 8, generator=g, **bf),
        torch.zeros(1, T, dtype=torch.long, device=DEV),
        a.topk,
    )

    def attn():
        o, _ = fused.sparse_attention(q, kv, kv[..., :E], idx, 0.07, True)
        o.backward(do)

    defaults = dict(fused.CONFIG)
    for name, cands in CANDIDATES.items():
        for cand in cands:
            fused.CONFIG.update(defaults)
            fused.CONFIG[name] = cand
            try:
                print(f"{name} {cand}: {timed(attn):.1f} ms", flush=True)
            except Exception as err:  # a config that does not compile (shared memory)
                print(f"{name} {cand}: failed ({type(err).__name__}: {str(err)[:80]})", flush=True)
    fused.CONFIG.update(defaults)


def dims(a) -> tuple[int, int, int, int, int, int]:
    """H query heads, D the absorbed query/key width, E the value width, J index heads of Dh, rope."""
    return a.heads, 576, 512, a.index_heads, 128, 64


def measure(a, T: int) -> list[dict]:
    """One length: each part's time on both paths and dense SDPA's, a row each (printed as it goes).
    Its tensors are this call's locals, freed when it returns."""
    H, D, E, J, Dh, rope = dims(a)
    bf: dict[str, Any] = dict(device=DEV, dtype=torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(T)
    qi = torch.randn(T, J, Dh, generator=g, **bf).requires_grad_()
    ki = torch.randn(T, Dh, generator=g, **bf).requires_grad_()
    w = (torch.randn(T, J, generator=g, **bf) * J**-0.5).requires_grad_()
    q = torch.randn(T, H, D, generator=g, **bf).requires_grad_()
    kv = torch.randn(T, D, generator=g, **bf).requires_grad_()
    do = torch.randn(T, H, E, generator=g, **bf)
    scale = (128 + rope) ** -0.5
    starts = torch.zeros(1, T, dtype=torch.long, device=DEV)
    idx = fused.indexer_topk(qi[None], ki[None], w[None], starts, a.topk)

    def f_topk():
        fused.indexer_topk(qi[None], ki[None], w[None], starts, a.topk)

    def f_attn():
        o, p = fused.sparse_attention(q[None], kv[None, :, None], kv[None, :, None, :E], idx, scale, True)
        o.backward(do[None])
        return p

    target = f_attn()[0]

    def f_loss():
        fused.indexer_kl_loss(qi[None], ki[None], w[None], idx, target[None]).backward()

    ms_f = {"top-k": timed(f_topk), "attention": timed(f_attn), "loss": timed(f_loss)}
    c_idx, c_att = max(64, 2**26 // T), 512
    ms_g = {
        "top-k": timed(lambda: gather_topk(qi.detach(), ki.detach(), w.detach(), a.topk, c_idx)),
        "attention": timed(lambda: gather_attention(q, kv, idx[0], do, E, scale, c_att)),
        "loss": timed(lambda: gather_loss(qi, ki, w, idx[0], target, c_att)),
    }
    qd = torch.randn(1, H, T, 192, generator=g, **bf).requires_grad_()
    kd = torch.randn(1, H, T, 192, generator=g, **bf).requires_grad_()
    vd = torch.randn(1, H, T, 128, generator=g, **bf).requires_grad_()
    dod = torch.randn(1, H, T, 128, generator=g, **bf)
    dense = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(dod))
    ms_f["total"], ms_g["total"] = sum(ms_f.values()), sum(ms_g.values())
    keys = float((idx >= 0).sum()) / T
    att_flops = 3.5 * 2 * T * H * keys * (D + E)
    rows = []
    for part in ms_f:
        row = {
            "T": T,
            "part": part,
            "gather_ms": ms_g[part],
            "triton_ms": ms_f[part],
            "speedup": ms_g[part] / ms_f[part],
            "dense_ms": dense,
            "vs_dense": dense / ms_f[part],
        }
        tf = ""
        if part == "attention":
            row["tflops"] = att_flops / ms_f[part] / 1e9
            tf = f"{row['tflops']:.0f}"
        rows.append(row)
        print(
            f"| {T} | {part} | {ms_g[part]:.1f} | {ms_f[part]:.1f} | {row['speedup']:.2f}x | {tf} | "
            f"{dense:.1f} | {row['vs_dense']:.2f}x |",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--out", default="bench/results/dsa.json")
    ap.add_argument("--tune", action="store_true", help="time other block sizes of the attention kernels instead")
    a = ap.parse_args()
    if a.tune:
        return tune(a)
    H, D, E, J, Dh, _ = dims(a)
    rows = []
    print(
        f"{accelerator.name(DEV)}, torch {torch.__version__}; H={H}, D={D}, E={E}, index {J}x{Dh}, "
        f"top-{a.topk}, bf16, fwd+bwd"
    )
    print("| T | part | gather ms | Triton ms | Triton / gather | attention TFLOP/s | dense SDPA ms | vs dense |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T in a.seq:
        rows += measure(a, T)
        accelerator.empty_cache(DEV)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "device": accelerator.name(DEV),
                "torch": torch.__version__,
                "heads": H,
                "dims": [D, E],
                "index": [J, Dh],
                "topk": a.topk,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
