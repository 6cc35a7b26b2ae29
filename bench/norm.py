"""RMSNorm and the gated RMSNorm, forward and forward + backward: the Triton kernels
(kernels/norm/triton.py) against the reference the model ran before them (PyTorch ops in fp32),
in one run.

    python3 -m bench.norm    # the hidden norms at 4096 and 7168 wide, KDA's gated norm per head

bf16 x (and gate), an fp32 frozen weight as a LoRA job keeps it (rms_norm's result is then fp32,
as the reference's). GB/s counts the bytes a pass must move at least: x (and the gate) and y
forward; x, dy and dx (and the gate and its gradient) for forward + backward. Median of 20 timed
calls after 5. Baseline: the reference. Writes bench/results/norm.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.cuda_time import median_ms
from kernels.norm import reference
from kernels.norm import triton as ours

BASELINE = "PyTorch reference"
CASES = [("rms_norm", (16384, 4096)), ("rms_norm", (16384, 7168)), ("gated_rms_norm", (16384, 32, 128))]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "norm.json")
    args = p.parse_args(argv)
    rows = []
    for op, shape in CASES:
        g = torch.Generator(device="cuda").manual_seed(sum(shape))
        x = torch.randn(*shape, device="cuda", generator=g).bfloat16().requires_grad_()
        gate = torch.randn(*shape, device="cuda", generator=g).bfloat16().requires_grad_() if op.startswith("gated") else None
        w = 1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)
        args_of = (lambda: (x, gate, w, 1e-6)) if gate is not None else (lambda: (x, w, 1e-6))
        inputs = [x] if gate is None else [x, gate]
        y = getattr(reference, op)(*args_of())
        dy = torch.randn_like(y)
        n = x.numel()
        fwd_bytes = n * 2 * len(inputs) + n * y.element_size()
        both_bytes = fwd_bytes + n * y.element_size() + n * 2 * 2 * len(inputs)
        base = {}
        for name, impl in ((BASELINE, reference), ("Kiln Triton", ours)):
            fn = getattr(impl, op)
            with torch.no_grad():
                err = float((fn(*args_of()).float() - y.float()).norm() / y.float().norm())
            fwd = median_ms(lambda: fn(*args_of()), 20, 5)
            both = median_ms(lambda: torch.autograd.grad(fn(*args_of()), inputs, dy), 20, 5)
            base = base or {"fwd": fwd, "both": both}
            rows.append({"op": op, "shape": list(shape), "method": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                         "fwd_GBps": fwd_bytes / fwd / 1e6, "fwd_bwd_GBps": both_bytes / both / 1e6,
                         "fwd_speedup": base["fwd"] / fwd, "fwd_bwd_speedup": base["both"] / both, "rel_err": err})
    print(f"\nRMSNorm, bf16 x, fp32 frozen weight, {torch.cuda.get_device_name()}; baseline: {BASELINE}")
    print(f"{'op':<15} {'shape':<16} {'method':<18} {'fwd ms':>7} {'GB/s':>6} {'x base':>7} "
          f"{'f+b ms':>7} {'GB/s':>6} {'x base':>7} {'rel err':>8}")
    for r in rows:
        print(f"{r['op']:<15} {'x'.join(map(str, r['shape'])):<16} {r['method']:<18} {r['fwd_ms']:>7.3f} "
              f"{r['fwd_GBps']:>6.0f} {r['fwd_speedup']:>6.2f}x {r['fwd_bwd_ms']:>7.3f} {r['fwd_bwd_GBps']:>6.0f} "
              f"{r['fwd_bwd_speedup']:>6.2f}x {r['rel_err']:>8.1e}")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "baseline": BASELINE, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
