"""MoE experts, forward + backward (gradients of the rows and of the expert weights), at
realistic shapes: the per-expert loop (kiln_kernels/moe/reference.py), torch._grouped_mm
(kiln_kernels/moe/grouped.py, the engine's CUDA path), the Triton grouped GEMM
(kiln_kernels/experimental/grouped_gemm.py, not used by the engine) and, as the ceiling, one dense
bf16 GEMM chain of the same FLOPs, in one run.

    python3 -m bench.moe        # tokens 16k / 64k, experts 64 / 256, top-8 / 16, D 2048, I 1024, bf16
    python3 -m bench.moe --tune # first the Triton grouped GEMM's configurations, each GEMM alone against
                                # torch's (16k tokens, 64 experts), then the table with the best

Rows per expert follow a random router (softmax of Gaussian logits, top-k), so groups are uneven
as in training. 18 M D I FLOPs a call (M = tokens * k). Median of 5 timed calls after 2.
Writes its results (with --tune, every candidate's times and the configuration used) as variant
``--variant`` (default "default") of bench/results/moe.json, keeping the file's other variants
(bench/variants.py).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.cuda_time import DEV, median_ms
from bench.variants import write_variant
from engine import device as accelerator
from kiln_kernels.experimental import grouped_gemm
from kiln_kernels.moe import grouped, reference
from kiln_kernels.moe import triton as fused
from kiln_kernels.moe.reference import swiglu  # the engine's: the fused kernel on CUDA


def timed(fn, params) -> float:
    def call():
        for p in params:
            p.grad = None
        fn().float().sum().backward()

    return median_ms(call, reps=5, warmup=2)


def move(N: int, E: int, k: int, D: int, g: torch.Generator) -> dict:
    """The tokens' rows to expert order and back with routing weights, forward + backward."""
    idx = torch.randn(N, E, device=DEV, generator=g).topk(k, -1)[1]
    x = torch.randn(N, D, device=DEV, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(N, k, device=DEV, generator=g, requires_grad=True)  # fp32, as the router gives
    order = torch.argsort(idx.flatten(), stable=True)
    tok = order // k
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=DEV)
    inv = inv.view(N, k)

    def torch_way():
        y = x[tok] * (1.5 * w.reshape(-1)[order, None])  # stands in for the experts, which weigh their rows
        return torch.zeros_like(x, dtype=w.dtype).index_add_(0, tok, y)

    def triton_way():
        return fused.unpermute(fused.permute(x, tok, inv) * (1.5 * w.reshape(-1)[order, None]), inv)

    return {
        "tokens": N,
        "experts": E,
        "top_k": k,
        "torch_ms": timed(torch_way, [x, w]),
        "triton_ms": timed(triton_way, [x, w]),
    }


# Candidates (2026-12-03 on the H200, y / dx / dW against torch: 128 x 128 tiles, 256 x 128,
# BK 128 for the rows, and 256 x 64 or 128 x 128 for dW were slower; bench/RESULTS.md). TMA: tiles
# through descriptors made on the device, persistent; WS warp-specialised; FLAT the tile and
# reduction loops pipelined as one; STORE 1 / 2 whole tiles stored by TMA (2: in two halves);
# ONE (dW) one descriptor per tensor, the next group's rows zeroed in registers.
ROWS = [
    dict(BM=128, BN=256, BK=64, GROUP=8, TMA=True, WS=1, num_warps=4, num_stages=4),  # the default before 2026-12-04
    dict(BM=128, BN=256, BK=64, GROUP=8, TMA=True, FLAT=1, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=64, GROUP=8, TMA=True, FLAT=1, STORE=2, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=64, GROUP=8, TMA=True, FLAT=1, STORE=1, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=64, GROUP=8, TMA=True, FLAT=1, STORE=2, num_warps=8, num_stages=4),
]
WEIGHTS = [
    dict(BM=64, BN=128, BK=256, num_warps=8, num_stages=4),  # pointer loads, the default before 2026-12-04
    dict(BM=64, BN=256, BK=128, TMA=True, WS=1, num_warps=4, num_stages=4),
    dict(BM=64, BN=128, BK=256, TMA=True, WS=1, num_warps=4, num_stages=4),
    dict(BM=64, BN=256, BK=128, TMA=True, WS=1, FLAT=1, num_warps=4, num_stages=4),
]


def tune(D: int, I: int) -> list[dict]:
    """Each GEMM of the gate/up projection alone (16k tokens, 64 experts, top-8) with each
    candidate configuration against torch's; CONFIG takes the best rows and weights entries.
    Returns each candidate's times (ms; None where it failed) and torch's."""
    g = torch.Generator(device=DEV).manual_seed(0)
    N, E, k = 16384, 64, 8
    idx = torch.randn(N, E, device=DEV, generator=g).softmax(-1).topk(k, -1)[1].flatten()
    counts = torch.bincount(idx, minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    M = int(counts.sum())
    x = torch.randn(M, D, device=DEV, generator=g, dtype=torch.bfloat16)
    W = (torch.randn(E, 2 * I, D, device=DEV, generator=g) * D**-0.5).bfloat16()
    dy = torch.randn(M, 2 * I, device=DEV, generator=g, dtype=torch.bfloat16)
    clock = lambda fn: median_ms(fn, reps=10, warmup=3)
    want = {
        "y": grouped.gmm(x, W, offs),
        "dx": torch._grouped_mm(dy, W, offs=offs),
        "dW": torch._grouped_mm(dy.T, x, offs=offs),
    }
    theirs = {
        "y": clock(lambda: grouped.gmm(x, W, offs)),
        "dx": clock(lambda: torch._grouped_mm(dy, W, offs=offs)),
        "dW": clock(lambda: torch._grouped_mm(dy.T, x, offs=offs)),
    }
    print("torch._grouped_mm ms: " + ", ".join(f"{n} {t:.3f}" for n, t in theirs.items()), flush=True)
    tried: list[dict] = [{"which": "torch._grouped_mm", "ms": theirs}]
    ours = {
        "y": lambda: grouped_gemm._rows_gemm(x, W, offs, False),
        "dx": lambda: grouped_gemm._rows_gemm(dy, W, offs, True),
        "dW": lambda: grouped_gemm._weights_gemm(dy, x, offs, E),
    }
    for which, cands, gemms in [("rows", ROWS, ["y", "dx"]), ("weights", WEIGHTS, ["dW"])]:
        best: dict[str, int] | None = None
        best_ms = float("inf")
        for cfg in cands:
            grouped_gemm.CONFIG[which] = cfg
            try:
                err = {n: ((ours[n]().float() - want[n].float()).norm() / want[n].float().norm()).item() for n in gemms}
                ms = {n: clock(ours[n]) for n in gemms}
            except Exception as error:  # too much shared memory, or the compiler refused
                print(f"{which} {cfg}: failed ({str(error)[:200]})", flush=True)
                tried.append({"which": which, "config": cfg, "ms": None})
                continue
            tried.append({"which": which, "config": cfg, "ms": ms, "error": err})
            print(
                f"{which} {cfg}: "
                + ", ".join(f"{n} {t:.3f} ms ({theirs[n] / t:.2f}x torch, error {err[n]:.1e})" for n, t in ms.items()),
                flush=True,
            )
            if sum(ms.values()) < best_ms and max(err.values()) < 1e-2:
                best, best_ms = cfg, sum(ms.values())
        assert best is not None, f"no {which} configuration compiled"
        grouped_gemm.CONFIG[which] = best
    return tried


def measure(N: int, E: int, k: int, D: int, I: int) -> tuple[list[dict], dict]:
    """One case of N tokens, E experts, top-k: each method's row (printed as it goes), then the
    permute's times. Its tensors are this call's locals, freed when it returns."""
    g = torch.Generator(device=DEV).manual_seed(N + E)
    idx = torch.randn(N, E, device=DEV, generator=g).softmax(-1).topk(k, -1)[1].flatten()
    counts = torch.bincount(idx, minlength=E)
    M = int(counts.sum())
    x = torch.randn(M, D, device=DEV, generator=g, dtype=torch.bfloat16, requires_grad=True)
    W1 = (torch.randn(E, 2 * I, D, device=DEV, generator=g) * D**-0.5).bfloat16().requires_grad_()
    W2 = (torch.randn(E, D, I, device=DEV, generator=g) * I**-0.5).bfloat16().requires_grad_()
    d1 = (torch.randn(D, 2 * I, device=DEV, generator=g) * D**-0.5).bfloat16().requires_grad_()
    d2 = (torch.randn(I, D, device=DEV, generator=g) * I**-0.5).bfloat16().requires_grad_()

    def dense():
        gate, up = (x @ d1).chunk(2, -1)
        return swiglu(gate, up) @ d2

    methods = {
        "per-expert loop": lambda: reference.grouped_mlp(x, counts, W1, W2, swiglu),
        "torch._grouped_mm": lambda: grouped.grouped_mlp(x, counts, W1, W2, swiglu),
        "Triton grouped GEMM": lambda: grouped_gemm.grouped_mlp(x, counts, W1, W2, swiglu),
        "dense GEMMs (ceiling)": dense,
    }
    ms = {name: timed(fn, [x, W1, W2, d1, d2]) for name, fn in methods.items()}
    flops = 18 * M * D * I
    rows = []
    for name, t in ms.items():
        row = {
            "tokens": N,
            "experts": E,
            "top_k": k,
            "method": name,
            "ms": t,
            "tflops": flops / t / 1e9,
            "vs_grouped_mm": ms["torch._grouped_mm"] / t,
            "vs_dense": ms["dense GEMMs (ceiling)"] / t,
        }
        rows.append(row)
        print(
            f"| {N} | {E} | {k} | {name} | {t:.2f} | {row['tflops']:.0f} | {row['vs_grouped_mm']:.2f}x | "
            f"{row['vs_dense']:.2f}x |"
        )
    return rows, move(N, E, k, D, g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--experts", type=int, nargs="+", default=[64, 256])
    p.add_argument("--top-k", type=int, nargs="+", default=[8, 16])
    p.add_argument("--tune", action="store_true")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument(
        "--variant",
        default="default",
        help="the name this run's results are kept under in the results file (its other variants stay)",
    )
    p.add_argument(
        "--out",
        default="bench/results/moe.json",
        help="the results file: the bench's own by default, another path for a trial run",
    )
    a = p.parse_args()
    D, I = a.hidden, a.inter
    rows: list[dict] = []
    moves: list[dict] = []
    tried: list[dict] = []
    if a.tune:
        tried = tune(D, I)
        print(f"with {grouped_gemm.CONFIG}\n")
    print(f"{accelerator.name(DEV)}, torch {torch.__version__}; D={D}, I={I}, bf16, fwd+bwd")
    print("| tokens | experts | top-k | method | ms | TFLOP/s | vs torch._grouped_mm | vs dense |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for N, E, k in [(N, E, k) for N in a.tokens for E in a.experts for k in a.top_k]:
        case_rows, moved = measure(N, E, k, D, I)
        rows += case_rows
        moves.append(moved)
        accelerator.empty_cache(DEV)
    print("\npermute + unpermute with routing weights, fwd+bwd")
    print("| tokens | experts | top-k | torch ms (index, index_add_) | Triton ms | torch / Triton |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in moves:
        print(
            f"| {m['tokens']} | {m['experts']} | {m['top_k']} | {m['torch_ms']:.2f} | {m['triton_ms']:.2f} | "
            f"{m['torch_ms'] / m['triton_ms']:.2f}x |"
        )
    write_variant(
        a.out,
        a.variant,
        {
            "device": accelerator.name(DEV),
            "torch": torch.__version__,
            "hidden": D,
            "inter": I,
            "rows": rows,
            "permute": moves,
            "tune": tried,
            "config": grouped_gemm.CONFIG,
        },
        "bench.moe",
        sys.argv[1:],
    )


if __name__ == "__main__":
    main()
