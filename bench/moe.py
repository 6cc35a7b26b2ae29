"""MoE experts, forward + backward (gradients of the rows and of the expert weights), at
realistic shapes: the per-expert loop (kernels/moe/reference.py), torch._grouped_mm
(kernels/moe/grouped.py, today's CUDA path) and, as the ceiling, one dense bf16 GEMM chain of the
same FLOPs, in one run.

    python3 -m bench.moe        # tokens 16k / 64k, experts 64 / 256, top-8, D 2048, I 1024, bf16

Rows per expert follow a random router (softmax of Gaussian logits, top-k), so groups are uneven
as in training. 18 M D I FLOPs a call (M = tokens * k). Median of 5 timed calls after 2.
Writes bench/results/moe.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.moe import grouped, reference


def swiglu(g, u):
    return F.silu(g) * u


def timed(fn, params, reps=5) -> float:
    def call():
        for p in params:
            p.grad = None
        fn().float().sum().backward()

    for _ in range(2):
        call()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--experts", type=int, nargs="+", default=[64, 256])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--out", default="bench/results/moe.json")
    a = p.parse_args()
    D, I, k = a.hidden, a.inter, a.top_k
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; D={D}, I={I}, top-{k}, bf16, fwd+bwd")
    print("| tokens | experts | method | ms | TFLOP/s | vs torch._grouped_mm | vs dense |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for N in a.tokens:
        for E in a.experts:
            g = torch.Generator(device="cuda").manual_seed(N + E)
            idx = torch.randn(N, E, device="cuda", generator=g).softmax(-1).topk(k, -1)[1].flatten()
            counts = torch.bincount(idx, minlength=E)
            M = int(counts.sum())
            x = torch.randn(M, D, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
            W1 = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * D ** -0.5).bfloat16().requires_grad_()
            W2 = (torch.randn(E, D, I, device="cuda", generator=g) * I ** -0.5).bfloat16().requires_grad_()
            d1 = (torch.randn(D, 2 * I, device="cuda", generator=g) * D ** -0.5).bfloat16().requires_grad_()
            d2 = (torch.randn(I, D, device="cuda", generator=g) * I ** -0.5).bfloat16().requires_grad_()

            def dense():
                gate, up = (x @ d1).chunk(2, -1)
                return swiglu(gate, up) @ d2

            methods = {"per-expert loop": lambda: reference.grouped_mlp(x, counts, W1, W2, swiglu),
                       "torch._grouped_mm": lambda: grouped.grouped_mlp(x, counts, W1, W2, swiglu),
                       "dense GEMMs (ceiling)": dense}
            ms = {name: timed(fn, [x, W1, W2, d1, d2]) for name, fn in methods.items()}
            flops = 18 * M * D * I
            for name, t in ms.items():
                row = {"tokens": N, "experts": E, "method": name, "ms": t, "tflops": flops / t / 1e9,
                       "vs_grouped_mm": ms["torch._grouped_mm"] / t, "vs_dense": ms["dense GEMMs (ceiling)"] / t}
                rows.append(row)
                print(f"| {N} | {E} | {name} | {t:.2f} | {row['tflops']:.0f} | {row['vs_grouped_mm']:.2f}x | "
                      f"{row['vs_dense']:.2f}x |")
            del x, W1, W2, d1, d2
            torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                       "hidden": D, "inter": I, "top_k": k, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
