"""Every Ascend Triton kernel lowered to triton-ascend's ttadapter IR (linalg, HIVM, HFusion: what
its NPU compiler takes), at the signatures and dtypes the ops launch it with, on a CPU without
CANN (the binary stage needs CANN, and is not run).

The ops' host code runs for real (``kiln_kernels.dispatch.OPS``' Ascend modules, fp32 and bf16,
forward and backward, on CPU tensors) with the NPU's choices (dot precision, core counts), and
every launch is caught before it runs: triton-ascend's ``JITFunction.run`` makes the signature and
specialisation as on an NPU (triton.compiler.compile is where it would compile), this compiles it
to ttir and ttadapter, and the launch is dropped (the outputs stay uninitialised: nothing reads
them but the next launches, which are only compiled). Run with triton-ascend first on the path:
``PYTHONPATH=.triton-ascend:. python -m tests.ascend.lower`` (scripts/check_ascend.sh does).
Prints a table, kernel by kernel (kiln_kernels/ASCEND.md has it); exits non-zero when a kernel
does not lower or an op's host code fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TARGET_ARCH = "Ascend910B3"
CORES = (20, 40)  # the 910B3's AI (cube) and vector cores, as torch_npu reports them
KERNEL_MODULES = ["norm.triton", "conv.triton", "kda.gate", "kda.triton", "loss.triton", "attnres.triton"]
KERNEL_MODULES += ["dsa.triton", "moe.triton"]


@dataclass
class Lowered:
    kernel: str  # module.function
    variant: str  # the case that launched it first
    signature: dict[str, str]
    constants: dict[str, Any]
    ok: bool
    error: str = ""
    seconds: float = 0.0
    ir_lines: int = 0  # of the ttadapter module


RESULTS: dict[tuple, Lowered] = {}
CASE = ["?"]
REPEAT = [1]  # ttadapter runs a specialisation: its pass TritonToUnstructure crashed one in ~2% of runs


def _lower_stub(triton: Any) -> Callable:
    """``triton.compiler.compile`` for the NPU target up to ttadapter; the kernel it returns
    launches nothing."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    class Dropped:
        function = None
        packed_metadata = None

        def launch_metadata(self, *args):
            return None

        def _init_handles(self):
            pass

        def run(self, *args, **kwargs):
            pass

    def compile(src: Any, target: Any = None, options: Any = None) -> Any:
        backend = make_backend(target)
        opts = backend.parse_options(dict(options or {}))
        key = (
            src.fn.fn.__module__ + "." + src.fn.__name__,
            json.dumps(src.signature, sort_keys=True),
            repr(src.constants),
        )
        if key not in RESULTS:
            got = Lowered(
                kernel=key[0].removeprefix("kiln_kernels."),
                variant=CASE[0],
                signature=dict(src.signature),
                constants={str(k): v for k, v in src.constants.items() if not isinstance(v, type(None))},
                ok=False,
            )
            start = time.perf_counter()
            try:
                stages: dict[str, Callable] = {}
                backend.add_stages(stages, opts)
                context = ir.context()
                ir.load_dialects(context)
                backend.load_dialects(context)
                module = src.make_ir(opts, backend.get_codegen_implementation(), backend.get_module_map(), context)
                metadata = {"hash": "0" * 64, "target": target, **opts.__dict__}
                module = stages["ttir"](module, metadata)
                out, crashed, first = None, 0, None
                for _ in range(REPEAT[0]):  # the same input again: a crash that comes only now and then
                    try:
                        out = stages["ttadapter"](module, metadata)
                    except Exception as e:
                        crashed, first = crashed + 1, first or e
                if out is None:  # every run failed: the first one's error
                    assert first is not None
                    raise first
                got.ir_lines = str(out).count("\n")
                got.ok = "func.func" in str(out) and not crashed
                if crashed:
                    got.error = f"ttadapter failed in {crashed} of {REPEAT[0]} runs"
                elif not got.ok:
                    got.error = "no function in the ttadapter module"
            except Exception as e:  # a kernel that does not lower: the table says why
                stderr = getattr(e, "stderr", None)
                text = stderr.decode() if isinstance(stderr, bytes) else str(e) or type(e).__name__
                lines = [ln for ln in text.splitlines() if "error" in ln.lower()] or text.splitlines() or [repr(e)]
                got.error = lines[0].strip()[:300]
            got.seconds = time.perf_counter() - start
            RESULTS[key] = got
        return Dropped()

    return compile


def install() -> Any:
    """triton-ascend, its NPU target without a device, and the NPU's choices in the kernels' host code."""
    import triton
    import triton.compiler
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    assert "ascend" in triton.backends.backends, f"not triton-ascend: {triton.__file__}"

    class NoDevice:
        """The NPU driver's face to JITFunction.run: the 910B3 target, device 0, no stream."""

        def get_current_target(self):
            return GPUTarget("npu", TARGET_ARCH, 0)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(NoDevice())
    triton.compiler.compile = _lower_stub(triton)

    def npu_precision(t: torch.Tensor) -> str:
        return "ieee"  # dispatch.dot_precision on an NPU tensor

    def npu_sms(t: torch.Tensor, vector: bool = False) -> int:
        return CORES[1 if vector else 0]  # dispatch.sms on a 910B3's tensor

    for name in KERNEL_MODULES:  # the modules' own names for dispatch's functions
        module = importlib.import_module("kiln_kernels." + name)
        for attr, fn in (("dot_precision", npu_precision), ("sms", npu_sms)):
            if hasattr(module, attr):
                setattr(module, attr, fn)
    return triton


def _grad(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.requires_grad_() for x in xs]


def _backward(out: Any) -> None:
    outs = out if isinstance(out, tuple | list) else (out,)
    tensors = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def cases(dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """One call per op at a production width (Kimi Linear's and K2's), few tokens: the constexpr
    tiles are those of training, the host work small."""
    import kiln_kernels.attnres.triton as attnres
    import kiln_kernels.conv.triton as conv
    import kiln_kernels.dsa.triton as dsa
    import kiln_kernels.kda.gate as gate
    import kiln_kernels.kda.triton as kda
    import kiln_kernels.loss.triton as loss
    import kiln_kernels.moe.triton as moe
    import kiln_kernels.norm.triton as norm

    def r(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, dtype=dt)

    def norms():
        x, w, g = _grad(r(2, 64, 2304), torch.ones(2304), r(2, 64, 2304))
        _backward(norm.rms_norm(x, w, 1e-6))
        _backward(norm.gated_rms_norm(x, g, w, 1e-6))
        x = r(2, 64, 128).requires_grad_()  # a head's gated norm (KDA's output), the weight frozen
        _backward(norm.gated_rms_norm(x, r(2, 64, 128), torch.ones(128), 1e-6))

    def short_conv():
        x, w = _grad(r(2, 128, 4096), r(4096, 1, 4))
        _backward(conv.short_conv(x, w, torch.tensor([0, 100, 256]), head_norm=128))
        _backward(conv.short_conv(x, w))

    def kda_gate():
        g, a, b = _grad(r(2, 64, 32, 128), r(32, dt=torch.float32), r(32, 128, dt=torch.float32))
        _backward(gate.kda_gate(g, a, b, lower_bound=-5.0))
        _backward(gate.kda_gate(g, a, None, None))

    def kda_chunk():
        B, T, H, K = 1, 200, 4, 128
        q, k, v = _grad(r(B, T, H, K), r(B, T, H, K), r(B, T, H, K))
        g = (-torch.rand(B, T, H, K)).to(dtype).requires_grad_()
        beta = torch.rand(B, T, H, dtype=dtype).requires_grad_()
        h0 = torch.zeros(2, H, K, K, requires_grad=True)
        _backward(kda.kda_chunk(q, k, v, g, beta, K**-0.5, h0, torch.tensor([0, 70, 200])))
        # the model's form: the decay made inside the kernels from the gate's raw projection, K3's
        # safe gate with A_log and dt_bias trained (full training), the default one frozen (LoRA)
        raw, A, bias = _grad(r(B, T, H, K), r(H, dt=torch.float32), r(H, K, dt=torch.float32))
        _backward(kda.kda_chunk(q, k, v, raw, beta, K**-0.5, None, None, gate=kda.Gate(A, bias, -5.0)))
        _backward(kda.kda_chunk(q, k, v, raw, beta, K**-0.5, gate=kda.Gate(A.detach(), bias.detach())))

    def fused_loss():
        h, W = _grad(r(256, 256), r(16384, 256))  # a vocabulary past BLOCK: the row kernel's real block
        _backward(loss.linear_cross_entropy(h, W, torch.randint(0, 16384, (256,)))[0])

    def depth_attention():
        v, w = _grad(r(5, 2, 64, 2304), torch.randn(2304))
        _backward(attnres.depth_attention(v, w))

    def dsa_ops():
        B, T, J, DH, topk = 1, 300, 8, 128, 64
        q, k = r(B, T, J, DH), r(B, T, DH)
        w = r(B, T, J)
        starts = torch.zeros(B, T, dtype=torch.long)
        idx = dsa.indexer_topk(q, k, w, starts, topk)
        dsa.indexer_topk(q, k, w, starts, 16)  # the k-th best key through the groups' bound (_kth)
        # MLA absorbed: one latent key of 576 (512 + 64 rope), values its first 512
        H, D, E = 16, 576, 512
        qa, ka, va = _grad(r(B, T, H, D), r(B, T, 1, D), r(B, T, 1, E))
        qi, ki, wi = _grad(q.clone(), k.clone(), w.clone())
        _backward(dsa.sparse_attention(qa, ka, va, idx, D**-0.5))  # no indexer loss
        (kv,) = _grad(r(B, T, 1, D))  # the model's form: the values a view of the keys' first E dims
        _backward(dsa.sparse_attention(qa, kv, kv[..., :E], idx, D**-0.5, (qi, ki, wi)))  # its loss
        kg, vg = _grad(r(B, T, 2, D), r(B, T, 2, E))  # two key heads, several programs' target shares
        _backward(dsa.sparse_attention(qa, kg, vg, idx, D**-0.5, (qi, ki, wi)))
        p = torch.softmax(torch.randn(B, T, idx.shape[-1]), -1)
        _backward(dsa.indexer_kl_loss(qi, ki, wi, idx, p))

    def moe_rows():
        N, K, D = 64, 8, 2304
        x = r(N, D).requires_grad_()
        order = torch.randperm(N * K)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(N * K)
        y = moe.permute(x, order // K, inv.view(N, K))
        _backward(moe.unpermute(y, inv.view(N, K)))
        gu = r(N * K, 2 * 1024).requires_grad_()  # the experts' activation, I 1024, weighed or not
        _backward(moe.swiglu_rows(gu, torch.rand(N * K, requires_grad=True)))
        _backward(moe.swiglu_rows(gu))
        _backward(moe.swiglu(*_grad(r(N, 9216), r(N, 9216))))  # a dense MLP's (Kimi Linear's first layer)

    return {
        "norm": norms,
        "conv": short_conv,
        "kda_gate": kda_gate,
        "kda": kda_chunk,
        "loss": fused_loss,
        "attnres": depth_attention,
        "dsa": dsa_ops,
        "moe": moe_rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="ops to lower (default: all)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--repeat", type=int, default=1, help="lower each specialisation this many times (a changed kernel: 300)"
    )
    args = parser.parse_args(argv)
    REPEAT[0] = max(args.repeat, 1)
    install()
    torch.manual_seed(0)
    failed_cases = {}
    start = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16):
        for name, run in cases(dtype).items():
            if args.only and name not in args.only:
                continue
            CASE[0] = f"{name} {str(dtype).removeprefix('torch.')}"
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # triton-ascend's "DO NOT tune num_warps"
                    run()
            except Exception:  # the host code itself failed: a finding too
                failed_cases[CASE[0]] = traceback.format_exc(limit=3).splitlines()[-1]
    total = time.perf_counter() - start
    rows = sorted(RESULTS.values(), key=lambda r: (r.kernel, r.variant))
    print(f"{'kernel':28} {'first launched by':18} {'lowered':8} {'IR lines':>8}  why not")
    for r in rows:
        print(f"{r.kernel:28} {r.variant:18} {'yes' if r.ok else 'NO':8} {r.ir_lines:8}  {r.error}")
    for case, err in failed_cases.items():
        print(f"host code of {case} failed: {err}")
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)} of {len(rows)} specialisations lowered in {total:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1, default=str)
    return 1 if bad or failed_cases else 0


if __name__ == "__main__":
    sys.exit(main())
