"""KDA's chunked gated delta rule, forward and forward + backward: the Triton kernels
(kiln_kernels/kda/triton.py) against fla-core's chunk_kda (its wheel carried to the GPU machine) and
the PyTorch reference, in one run.

    python3 -m bench.kda           # 32k and 128k tokens in documents of 8k, 16 and 64 heads, d 128, bf16
    python3 -m bench.kda --tune    # first our kernels' other launch settings at the first shape,
                                   # then the shapes measured with each kernel's fastest

q, k (L2-normalised), v and beta in bf16; g in fp32 from the bounded gate (K3's, lower bound -5);
one packed row with cu_seqlens. FLOPs counted as in shared/MODEL_NOTES.md, per head
6 T d^2 + 3 T C d + T C^2 (C = 64) for the forward and three times that for forward + backward.
Tokens/s counts the packed row's tokens (all heads together).
Median of 5 timed calls after 2; peak memory over forward + backward, and of a training forward
alone with what it holds for the backward (``fwd_peak_gib``, ``fwd_held_gib``; the inputs
excluded). Baseline: fla-core. Writes bench/results/kda.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.cuda_time import DEV, median_ms, sweep
from engine import device as accelerator
from kiln_kernels.kda import reference
from kiln_kernels.kda import triton as ours


def inputs(T: int, H: int, d: int, doc: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(T + H)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)
    x = {
        "q": F.normalize(r(1, T, H, d), dim=-1).bfloat16(),
        "k": F.normalize(r(1, T, H, d), dim=-1).bfloat16(),
        "v": r(1, T, H, d).bfloat16(),
        "g": reference.kda_gate(r(1, T, H, d), r(H) * 0.5, r(H, d), -5.0),
        "beta": torch.sigmoid(r(1, T, H)).bfloat16(),
    }
    cu = torch.arange(0, T + 1, doc, device=DEV, dtype=torch.int32)
    return {n: t.requires_grad_() for n, t in x.items()}, cu


def methods() -> dict:
    found = {"Kiln Triton": lambda x, cu: ours.kda_chunk(**x, cu_seqlens=cu)}
    try:
        from fla.ops.kda import chunk_kda

        found["fla-core chunk_kda"] = lambda x, cu: chunk_kda(**x, cu_seqlens=cu.long(), output_final_state=True)
    except ImportError as err:
        print(f"fla-core is not installed ({err}): no baseline")
    found["PyTorch reference"] = lambda x, cu: reference.kda_chunk(**x, cu_seqlens=cu)
    return found


def measure(fn, x, cu) -> dict:
    def fwd():
        with torch.no_grad():
            fn(x, cu)

    def fwd_bwd():
        for t in x.values():
            t.grad = None
        o, ht = fn(x, cu)
        (o.float().sum() + ht.float().sum()).backward()

    try:
        f = median_ms(fwd, reps=5, warmup=2)
        accelerator.reset_peak(DEV)
        base = accelerator.allocated(DEV)
        fb = median_ms(fwd_bwd, reps=5, warmup=2)
        peak = (accelerator.max_allocated(DEV) - base) / 2**30
        for t in x.values():  # the timed backward's gradients are not the forward's to hold
            t.grad = None
        accelerator.reset_peak(DEV)
        out = fn(x, cu)  # a training forward: its peak, and what it holds for the backward with its outputs
        held = (accelerator.allocated(DEV) - base) / 2**30
        fwd_peak = (accelerator.max_allocated(DEV) - base) / 2**30
        del out
        return {"fwd_ms": f, "fwd_bwd_ms": fb, "peak_gib": peak, "fwd_peak_gib": fwd_peak, "fwd_held_gib": held}
    except torch.OutOfMemoryError:
        accelerator.empty_cache(DEV)
        return {}


def profile(T: int, H: int, d: int, doc: int) -> None:
    """The CUDA kernels' times of one forward + backward, ours and fla-core's."""
    x, cu = inputs(T, H, d, doc)
    for name, fn in methods().items():
        if name == "PyTorch reference":
            continue
        measure(fn, x, cu)  # compiled, tuned and warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            o, ht = fn(x, cu)
            (o.float().sum() + ht.float().sum()).backward()
            accelerator.synchronize(DEV)
        print(f"{name}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


# launch settings of our kernels to time (kiln_kernels.kda.triton.CONFIG's among them), for --tune
CANDIDATES: dict[str, list[dict[str, int]]] = {
    "solve": [dict(num_warps=8), dict(num_warps=4), dict(num_warps=2), dict(num_warps=1)],
    "intra": [dict(num_warps=2), dict(num_warps=4), dict(num_warps=1)],
    "wu": [
        dict(BW=128, num_warps=8),
        dict(BW=64, num_warps=4),
        dict(BW=64, num_warps=8),
        dict(BW=32, num_warps=4),
        dict(BW=128, num_warps=4),
    ],
    "states": [
        dict(BV=64, num_stages=2),
        dict(BV=32, num_stages=2),
        dict(BV=64, num_warps=2, num_stages=2),
        dict(BV=32, num_warps=2, num_stages=3),
        dict(BV=64, num_warps=8, num_stages=2),
        dict(BV=64, num_stages=3),
        dict(BV=32, num_warps=8, num_stages=2),
        dict(BV=16, num_stages=2),
    ],
    "output": [dict(BV=64), dict(BV=128), dict(BV=128, num_warps=8), dict(BV=32)],
    "dstates": [
        dict(BV=64, num_stages=2),
        dict(BV=32, num_stages=2),
        dict(BV=64, num_warps=8, num_stages=2),
        dict(BV=32, num_warps=8, num_stages=2),
        dict(BV=16, num_stages=2),
    ],
    "dlocal": [dict(BV=32, num_warps=8), dict(BV=32, num_warps=4), dict(BV=64, num_warps=8)],
    "dintra": [dict(num_warps=2), dict(num_warps=4)],
}


def tune(T: int, H: int, d: int, doc: int) -> dict[str, dict]:
    """Each kernel's candidate launch settings at one shape, the others at theirs: our forward and
    forward + backward ms (a setting that does not compile says so); returns each kernel's
    fastest (forward + backward: a training step's time)."""
    x, cu = inputs(T, H, d, doc)
    fn = methods()["Kiln Triton"]

    def timing() -> tuple[str, float]:
        m = measure(fn, x, cu)
        return f"{m['fwd_ms']:.3f} / {m['fwd_bwd_ms']:.3f}", m["fwd_bwd_ms"]

    print(f"tune at {T} tokens x {H} heads (ms, forward / forward + backward)")
    best = sweep(ours.CONFIG, CANDIDATES, timing)
    print(f"fastest forward + backward: {best}", flush=True)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 64])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--doc", type=int, default=8192)
    p.add_argument("--reference-up-to", type=int, default=32768 * 16, help="largest tokens x heads for the reference")
    p.add_argument("--profile", action="store_true", help="first, the kernels' times at the first shape")
    p.add_argument(
        "--tune",
        action="store_true",
        help="first time other launch settings of our kernels at the first shape, then measure with the fastest",
    )
    p.add_argument("--out", default="bench/results/kda.json")
    a = p.parse_args()
    d, C = a.dim, 64
    if a.tune:
        ours.CONFIG.update(tune(a.tokens[0], a.heads[0], d, a.doc))
    print(f"{accelerator.name(DEV)}, torch {torch.__version__}; d={d}, documents of {a.doc}, bf16")
    print(
        "| tokens | heads | method | fwd ms | fwd Mtok/s | fwd TFLOP/s | fwd+bwd ms | fwd+bwd Mtok/s | "
        "fwd+bwd TFLOP/s | peak GiB (fwd+bwd) | fwd peak GiB | fwd held GiB | fwd vs fla | fwd+bwd vs fla |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    if a.profile:
        profile(a.tokens[0], a.heads[0], d, a.doc)
    rows = []
    for T in a.tokens:
        for H in a.heads:
            x, cu = inputs(T, H, d, a.doc)
            flops = H * (6 * T * d * d + 3 * T * C * d + T * C * C)
            res = {}
            for name, fn in methods().items():
                if name == "PyTorch reference" and T * H > a.reference_up_to:
                    continue
                res[name] = m = measure(fn, x, cu)
                print(
                    f"measured {T} x {H}, {name}: "
                    + (f"fwd {m['fwd_ms']:.2f} ms, fwd+bwd {m['fwd_bwd_ms']:.2f} ms" if m else "out of memory"),
                    file=sys.stderr,
                    flush=True,
                )  # kept if a later method runs out of time
            base = res.get("fla-core chunk_kda") or {}
            for name, m in res.items():
                if not m:
                    print(f"| {T} | {H} | {name} | out of memory | | | | | | | | | | |")
                    continue
                row = {
                    "tokens": T,
                    "heads": H,
                    "method": name,
                    **m,
                    "fwd_mtok_s": T / m["fwd_ms"] / 1e3,
                    "fwd_bwd_mtok_s": T / m["fwd_bwd_ms"] / 1e3,
                    "fwd_tflops": flops / m["fwd_ms"] / 1e9,
                    "fwd_bwd_tflops": 3 * flops / m["fwd_bwd_ms"] / 1e9,
                    "fwd_vs_fla": base["fwd_ms"] / m["fwd_ms"] if base else None,
                    "fwd_bwd_vs_fla": base["fwd_bwd_ms"] / m["fwd_bwd_ms"] if base else None,
                }
                rows.append(row)
                ratio = lambda v: f"{v:.2f}x" if v else "-"
                print(
                    f"| {T} | {H} | {name} | {m['fwd_ms']:.2f} | {row['fwd_mtok_s']:.2f} | {row['fwd_tflops']:.1f} | "
                    f"{m['fwd_bwd_ms']:.2f} | {row['fwd_bwd_mtok_s']:.2f} | {row['fwd_bwd_tflops']:.1f} | "
                    f"{m['peak_gib']:.1f} | {m['fwd_peak_gib']:.2f} | {m['fwd_held_gib']:.2f} | "
                    f"{ratio(row['fwd_vs_fla'])} | "
                    f"{ratio(row['fwd_bwd_vs_fla'])} |",
                    flush=True,
                )
            del x
            accelerator.empty_cache(DEV)
            # after every shape: a run cut short keeps what it measured
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(
                json.dumps(
                    {
                        "device": accelerator.name(DEV),
                        "torch": torch.__version__,
                        "dim": d,
                        "doc": a.doc,
                        "config": ours.CONFIG,  # our kernels' launch settings in this run
                        "rows": rows,
                    },
                    indent=2,
                )
            )


if __name__ == "__main__":
    main()
