"""RMSNorm and the gated RMSNorm, forward and forward + backward: the Triton kernels
(kiln_kernels/norm/triton.py) against the reference the model ran before them (PyTorch ops in fp32),
in one run.

    python3 -m bench.norm    # the hidden norms at 4096 and 7168 wide, KDA's gated norm per head

bf16 x (and gate), an fp32 frozen weight as a LoRA job keeps it (rms_norm's result is then fp32,
as the reference's). GB/s counts the bytes a pass must move at least: x (and the gate) and y
forward; x, dy and dx (and the gate and its gradient) for forward + backward. Median of 20 timed
calls after 5. Baseline: the reference. Writes bench/results/norm.json.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from bench.cuda_time import DEV, pass_row, report
from engine import device as accelerator
from kiln_kernels.norm import reference
from kiln_kernels.norm import triton as ours

BASELINE = "PyTorch reference"
CASES = [("rms_norm", (16384, 4096)), ("rms_norm", (16384, 7168)), ("gated_rms_norm", (16384, 32, 128))]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "norm.json")
    args = p.parse_args(argv)
    rows = []
    for op, shape in CASES:
        g = torch.Generator(device=DEV).manual_seed(sum(shape))
        x = torch.randn(*shape, device=DEV, generator=g).bfloat16().requires_grad_()
        gate = (
            torch.randn(*shape, device=DEV, generator=g).bfloat16().requires_grad_() if op.startswith("gated") else None
        )
        w = 1 + 0.1 * torch.randn(shape[-1], device=DEV, generator=g)
        call_args = (x, gate, w, 1e-6) if gate is not None else (x, w, 1e-6)
        inputs = [x] if gate is None else [x, gate]
        y = getattr(reference, op)(*call_args)
        dy = torch.randn_like(y)
        n = x.numel()
        fwd_bytes = n * 2 * len(inputs) + n * y.element_size()
        both_bytes = fwd_bytes + n * y.element_size() + n * 2 * 2 * len(inputs)
        base = None
        for name, impl in ((BASELINE, reference), ("Kiln Triton", ours)):
            fn = getattr(impl, op)
            row = pass_row(partial(fn, *call_args), inputs, dy, y, fwd_bytes, both_bytes, base)
            base = base or row
            rows.append({"op": op, "shape": "x".join(map(str, shape)), "method": name, **row})
    return report(
        f"RMSNorm, bf16 x, fp32 frozen weight, {accelerator.name(DEV)}",
        rows,
        {"op": 15, "shape": 16, "method": 18},
        BASELINE,
        args.out,
    )


if __name__ == "__main__":
    main()
