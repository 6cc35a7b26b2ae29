"""KDA's short convolution with SiLU, forward and forward + backward: the Triton kernel
(kiln_kernels/conv/triton.py) against the reference the model ran before it (F.conv1d on transposed
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
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.cuda_time import DEV, pass_row, report
from engine import device as accelerator
from kiln_kernels.conv import reference
from kiln_kernels.conv import triton as ours

BASELINE = "PyTorch reference"


def methods(norm: int) -> dict:
    found: dict[str, Callable] = {BASELINE: reference.short_conv, "Kiln Triton": ours.short_conv}
    if norm:
        return found
    try:
        from fla.modules.convolution import causal_conv1d

        def fla(x, w, cu, _):
            return causal_conv1d(
                x, w.view(w.shape[0], -1), activation="silu", cu_seqlens=cu.long() if cu is not None else None
            )[0]

        found["fla-core causal_conv1d"] = fla
    except ImportError as err:
        print(f"fla-core is not installed ({err}): no second baseline")
    return found


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "conv.json")
    args = p.parse_args(argv)
    rows = []
    for T, C, doc, norm in [
        (16384, 12288, None, 0),
        (16384, 12288, 4096, 0),
        (32768, 24576, 4096, 0),
        (16384, 4096, 4096, 128),
    ]:
        g = torch.Generator(device=DEV).manual_seed(T + C)
        x = torch.randn(1, T, C, device=DEV, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(C, 1, 4, device=DEV, generator=g) * 0.5).bfloat16()
        dy = torch.randn(1, T, C, device=DEV, generator=g).bfloat16()
        cu = torch.arange(0, T + 1, doc, device=DEV) if doc else None
        want = reference.short_conv(x, w, cu, norm)
        base = None
        for name, fn in methods(norm).items():
            row = pass_row(partial(fn, x, w, cu, norm), [x], dy, want, 2 * T * C * 2, 5 * T * C * 2, base)
            base = base or row
            rows.append({"T": T, "C": C, "doc": doc, "norm": norm, "method": name, **row})
    return report(
        f"short conv + SiLU, bf16, width 4, {accelerator.name(DEV)}",
        rows,
        {"T": 6, "C": 6, "doc": 5, "norm": 4, "method": 24},
        BASELINE,
        args.out,
    )


if __name__ == "__main__":
    main()
