"""KDA's short convolution with SiLU, forward and forward + backward: the Triton kernel
(kernels/conv/triton.py) against the reference the model ran before it (F.conv1d on transposed
views, the slice, SiLU; then q's and k's L2 norm per head in fp32) and, without the norm and when
its wheel is carried, fla-core's causal_conv1d, in one run.

    python3 -m bench.conv    # q, k, v together (12288 and 24576 channels), and q alone with its norm

bf16 activations, a bf16 frozen filter of width 4 (the trainer's LoRA setting: only dx in the
backward), one packed row with and without documents of 4096. GB/s counts the bytes a pass must
move at least: x and y forward; x, dy and dx for forward + backward. Median of 20 timed calls
after 5. Baseline: the reference. Writes bench/results/conv.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.cuda_time import median_ms
from kernels.conv import reference
from kernels.conv import triton as ours

BASELINE = "PyTorch reference"


def methods(norm: int) -> dict:
    found = {BASELINE: reference.short_conv, "Kiln Triton": ours.short_conv}
    if norm:
        return found
    try:
        from fla.modules.convolution import causal_conv1d

        def fla(x, w, cu, _):
            return causal_conv1d(x, w.view(w.shape[0], -1), activation="silu",
                                 cu_seqlens=cu.long() if cu is not None else None)[0]
        found["fla-core causal_conv1d"] = fla
    except ImportError as err:
        print(f"fla-core is not installed ({err}): no second baseline")
    return found


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "conv.json")
    args = p.parse_args(argv)
    rows = []
    for T, C, doc, norm in [(16384, 12288, None, 0), (16384, 12288, 4096, 0), (32768, 24576, 4096, 0),
                            (16384, 4096, 4096, 128)]:
        g = torch.Generator(device="cuda").manual_seed(T + C)
        x = torch.randn(1, T, C, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(C, 1, 4, device="cuda", generator=g) * 0.5).bfloat16()
        dy = torch.randn(1, T, C, device="cuda", generator=g).bfloat16()
        cu = torch.arange(0, T + 1, doc, device="cuda") if doc else None
        want = reference.short_conv(x, w, cu, norm)
        base = {}
        for name, fn in methods(norm).items():
            with torch.no_grad():
                err = float((fn(x, w, cu, norm).float() - want.float()).norm() / want.float().norm())
            fwd = median_ms(lambda: fn(x, w, cu, norm), 20, 5)
            both = median_ms(lambda: torch.autograd.grad(fn(x, w, cu, norm), x, dy), 20, 5)
            base = base or {"fwd": fwd, "both": both}
            rows.append({"T": T, "C": C, "doc": doc, "norm": norm, "method": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                         "fwd_GBps": 2 * T * C * 2 / fwd / 1e6, "fwd_bwd_GBps": 5 * T * C * 2 / both / 1e6,
                         "fwd_speedup": base["fwd"] / fwd, "fwd_bwd_speedup": base["both"] / both, "rel_err": err})
    print(f"\nshort conv + SiLU, bf16, width 4, {torch.cuda.get_device_name()}; baseline: {BASELINE}")
    print(f"{'T':>6} {'C':>6} {'docs':>5} {'norm':>4} {'method':<24} {'fwd ms':>7} {'GB/s':>6} {'x base':>7} "
          f"{'f+b ms':>7} {'GB/s':>6} {'x base':>7} {'rel err':>8}")
    for r in rows:
        print(f"{r['T']:>6} {r['C']:>6} {r['doc'] or '-':>5} {r['norm'] or '-':>4} {r['method']:<24} {r['fwd_ms']:>7.3f} {r['fwd_GBps']:>6.0f} "
              f"{r['fwd_speedup']:>6.2f}x {r['fwd_bwd_ms']:>7.3f} {r['fwd_bwd_GBps']:>6.0f} {r['fwd_bwd_speedup']:>6.2f}x "
              f"{r['rel_err']:>8.1e}")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "baseline": BASELINE, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
