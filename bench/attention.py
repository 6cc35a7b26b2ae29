"""Full attention over packed documents, forward and forward + backward, at Kimi-Linear-48B's MLA
shape (32 heads, q/k 192, v 128, bf16): every way torch offers, in one run, to keep the fastest
as ``kiln_kernels.attention.flash.BF16_BACKEND``.

    python3 -m bench.attention [--tokens 8192 32768 131072] [--doc 0 4096]

Methods: ``flash`` (varlen FlashAttention-2, v padded to 192), ``efficient`` (varlen
memory-efficient kernels), ``sdpa`` (equal documents as SDPA's batch: cuDNN), ``flex``
(FlexAttention with a document block mask, compiled; its compile time printed apart), ``sdpa
mask`` (today's before this bench: SDPA with a dense [T, T]
boolean mask, up to 32k tokens) and, for one document, ``sdpa causal`` (SDPA's own choice with
is_causal). ``--doc 0``: one document of all the tokens; ``--doc 4096``: documents of 4096.
FLOPs are the causal ones that count, 2 H (D + E) sum_n L_n (L_n + 1) / 2 forward and 3.5 times
that for forward + backward. Median of 5 after 2. Writes bench/results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.cuda_time import DEV, median_ms
from engine import device as accelerator
from kiln_kernels.attention import flash
from kiln_kernels.attention.reference import document_mask

H, D, E = 32, 192, 128


def inputs(T: int, doc: int):
    g = torch.Generator(device=DEV).manual_seed(T + doc)
    q, k = (torch.randn(T, H, D, device=DEV, generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(T, H, E, device=DEV, generator=g).bfloat16().requires_grad_()
    cu = torch.arange(0, T + 1, doc or T)
    return q, k, v, cu


def flex_method(T: int, cu: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=DEV), cu.diff().to(DEV))
    mask = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, T, T, device=DEV)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask, scale=D**-0.5
    )[0].transpose(0, 1)


def methods(T: int, cu: torch.Tensor) -> dict:
    out = {
        name: (lambda b: lambda q, k, v: flash.varlen_attention(q, k, v, cu, scale=D**-0.5, backend=b))(name)
        for name in flash.BACKENDS
    }
    try:
        out["flex"] = flex_method(T, cu)
    except Exception as e:  # the bench reports what it could not build
        print(f"flex: not built ({type(e).__name__}: {e})", file=sys.stderr)
    # 4-D: 3-D inputs take the math path
    sdpa = lambda q, k, v, **kw: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=D**-0.5, **kw
    )[0].transpose(0, 1)
    if T <= 32768:
        mask = document_mask(cu, cu, DEV)
        out["sdpa mask"] = lambda q, k, v: sdpa(q, k, v, attn_mask=mask)
    if len(cu) == 2:
        out["sdpa causal"] = lambda q, k, v: sdpa(q, k, v, is_causal=True)
    return out


def measure(fn, q, k, v) -> dict:
    do = torch.randn_like(fn(q, k, v))
    t0 = time.perf_counter()
    fn(q, k, v).backward(do)  # compiles, where it compiles
    accelerator.synchronize(DEV)
    first = time.perf_counter() - t0
    with torch.no_grad():
        f = median_ms(lambda: fn(q, k, v), 5, 2)
    accelerator.reset_peak(DEV)
    base = accelerator.allocated(DEV)
    fb = median_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), 5, 2)
    return {
        "fwd_ms": f,
        "fwd_bwd_ms": fb,
        "peak_gib": (accelerator.max_allocated(DEV) - base) / 2**30,
        "first_call_s": first,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--doc", type=int, nargs="+", default=[0, 4096])
    p.add_argument("--out", default="bench/results/attention.json")
    a = p.parse_args()
    print(f"{accelerator.name(DEV)}, torch {torch.__version__}; H {H}, q/k {D}, v {E}, bf16")
    print(
        "| tokens | documents | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak GiB | "
        "first call s | fwd+bwd vs flash |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for T in a.tokens:
        for doc in a.doc:
            q, k, v, cu = inputs(T, doc)
            L = cu.diff().double()
            flops = float(2 * H * (D + E) * (L * (L + 1) / 2).sum())
            res = {}
            for name, fn in methods(T, cu).items():
                try:
                    res[name] = measure(fn, q, k, v)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    print(f"{T} / {doc or T}: {name} failed: {str(e)[:200]}", file=sys.stderr, flush=True)
                    accelerator.empty_cache(DEV)
            base = res.get("flash")
            for name, m in res.items():
                row = {
                    "tokens": T,
                    "doc": doc or T,
                    "method": name,
                    **m,
                    "fwd_tflops": flops / m["fwd_ms"] / 1e9,
                    "fwd_bwd_tflops": 3.5 * flops / m["fwd_bwd_ms"] / 1e9,
                    "vs_flash": base["fwd_bwd_ms"] / m["fwd_bwd_ms"] if base else None,
                }
                rows.append(row)
                print(
                    f"| {T} | {T // (doc or T)} | {name} | {m['fwd_ms']:.2f} | {row['fwd_tflops']:.0f} | "
                    f"{m['fwd_bwd_ms']:.2f} | {row['fwd_bwd_tflops']:.0f} | {m['peak_gib']:.2f} | "
                    f"{m['first_call_s']:.1f} | " + (f"{row['vs_flash']:.2f}x |" if base else "- |"),
                    flush=True,
                )
            del q, k, v
            accelerator.empty_cache(DEV)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(
                json.dumps(
                    {
                        "device": accelerator.name(DEV),
                        "torch": torch.__version__,
                        "heads": H,
                        "qk_dim": D,
                        "v_dim": E,
                        "rows": rows,
                    },
                    indent=1,
                )
            )


if __name__ == "__main__":
    main()
