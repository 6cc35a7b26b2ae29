"""Linear + cross-entropy at LM-head size: time of forward + backward and the memory it adds,
for the naive loss (full logits, fp32 softmax), Liger's fused linear cross entropy, and ours
(kiln_kernels/loss/triton.py), in one run on the same inputs.

    python3 -m bench.loss                    # vocab 163840, 32768 tokens, hidden 4096 and 7168, bf16

Each method: 2 warm-up calls, then the median of 5 timed ones (device events: CUDA's, or an
NPU's); memory is ``max_memory_allocated`` during a call minus what was allocated before it (the
inputs, the weight and the gradients of the call before), so it counts what a method needs beyond
the gradients it returns: logits, softmax, chunk buffers, copies. The loss and
both gradients are checked against the naive one. Baselines: Liger (speed goal >= 1.0x) and naive
(memory goal <= 1/10). Writes bench/results/loss.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.cuda_time import DEV
from engine import device as accelerator


def naive(h, W, y):
    return F.cross_entropy((h @ W.t()).float(), y, ignore_index=-100)


def liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    return lambda h, W, y: fn(W, h, y)


def ours(h, W, y):
    from kiln_kernels.loss.triton import linear_cross_entropy

    return linear_cross_entropy(h, W, y)[0]


def measure(fn, h, W, y, reps: int = 5) -> dict:
    def call():
        h.grad = W.grad = None
        loss = fn(h, W, y)
        loss.backward()
        return loss

    for _ in range(2):
        call()
    accelerator.synchronize(DEV)
    base = accelerator.allocated(DEV)
    accelerator.reset_peak(DEV)
    times: list[float] = []
    last: dict[str, torch.Tensor] = {}

    def timed():
        last["loss"] = fn(h, W, y)
        last["loss"].backward()

    for _ in range(reps):
        h.grad = W.grad = None
        times.append(accelerator.elapsed_ms(DEV, timed))
    return {
        "ms": statistics.median(times),
        "extra_gb": (accelerator.max_allocated(DEV) - base) / 1e9,
        "loss": float(last["loss"].detach()),
        "dh": h.grad.clone(),
        "dW": W.grad.clone(),
    }


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--out", default="bench/results/loss.json")
    a = p.parse_args()
    methods = {"naive": naive, "liger": liger(), "ours": ours}
    rows = []
    print(f"{accelerator.name(DEV)}, torch {torch.__version__}; N={a.tokens}, V={a.vocab}, bf16")
    print(
        "| hidden | method | ms | extra GB | TFLOP/s | speed vs Liger | memory vs naive | loss err | dh err | dW err |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for D in a.hidden:
        g = torch.Generator(device=DEV).manual_seed(D)
        h = (torch.randn(a.tokens, D, device=DEV, generator=g) * 0.5).bfloat16().requires_grad_()
        W = (torch.randn(a.vocab, D, device=DEV, generator=g) * D**-0.5).bfloat16().requires_grad_()
        y = torch.randint(0, a.vocab, (a.tokens,), device=DEV, generator=g)
        y[torch.rand(a.tokens, device=DEV, generator=g) < 0.1] = -100
        res: dict[str, dict | None] = {}
        for name, fn in methods.items():
            try:
                res[name] = measure(fn, h, W, y)
            except torch.OutOfMemoryError:
                res[name] = None
            accelerator.empty_cache(DEV)
        ref = res["naive"]
        flops = 6 * a.tokens * a.vocab * D
        for name, r in res.items():
            if r is None:
                print(f"| {D} | {name} | OOM | | | | | | | |")
                continue
            row = {
                "hidden": D,
                "method": name,
                "ms": r["ms"],
                "extra_gb": r["extra_gb"],
                "tflops": flops / r["ms"] / 1e9,
                "speed_vs_liger": liger_row["ms"] / r["ms"] if (liger_row := res.get("liger")) else None,
                "memory_vs_naive": r["extra_gb"] / ref["extra_gb"] if ref else None,
                "loss_err": abs(r["loss"] - ref["loss"]) / ref["loss"] if ref else None,
                "dh_err": rel(r["dh"], ref["dh"]) if ref else None,
                "dW_err": rel(r["dW"], ref["dW"]) if ref else None,
            }
            rows.append(row)
            f = lambda v, spec: "" if v is None else format(v, spec)
            print(
                f"| {D} | {name} | {r['ms']:.1f} | {r['extra_gb']:.2f} | {row['tflops']:.0f} | "
                f"{f(row['speed_vs_liger'], '.2f')}x | {f(row['memory_vs_naive'], '.3f')} | "
                f"{f(row['loss_err'], '.1e')} | "
                f"{f(row['dh_err'], '.1e')} | {f(row['dW_err'], '.1e')} |"
            )
        del h, W, y, res
        accelerator.empty_cache(DEV)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "device": accelerator.name(DEV),
                "torch": torch.__version__,
                "tokens": a.tokens,
                "vocab": a.vocab,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
