"""Registers, spills and shared memory of KDA's and DSA's kernels on the H200 (sm_90a), compiled
offline: Triton to PTX on this machine, then ptxas -v (the one in Triton's wheel). No GPU needed:
a kernel that spills in a sequential loop, or asks more shared memory than a block may have, is
found before a device is lent.

    python3 -m bench.regs          # every kernel at its CONFIG's settings (kiln_kernels.kda.triton, .dsa.triton)
    python3 -m bench.regs --tune   # and at bench.kda's and bench.dsa's candidate settings
    python3 -m bench.regs "dsa fwd hopper" "dsa walk hopper"   # those named only (DSA's Gluon kernels)

Shapes: Kimi Linear's KDA head (K = V = 128) and the hybrid's absorbed MLA for DSA (64 heads, q/k
576, v 512; its indexer 64 heads of 128), bf16 inputs, tf32 products where the kernels take them;
the arguments carry the launcher's alignment hints (``aligned``). Prints a line per kernel and
setting: registers a thread, spill stores and loads (bytes), the asynchronous copies (cp.async:
loads the software pipeline issues ahead of their use) in the kernel's TTGIR and how many buffers
a tile gets (n: its loads n - 1 iterations ahead; a gather whose rows come from an index load of
the same loop gets 2, one block ahead, at 3 stages, and 3 from 5), whether its products run on
wgmma (and whether ptxas serialises them, C7514: an accumulator read while its product is in
flight), and the shared memory a block takes (over 227 KB it cannot launch). Gluon kernels
(kiln_kernels/dsa/hopper.py) compile the same way, at their fixed settings.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from bench import dsa as dsa_bench
from bench import kda as kda_bench
from kiln_kernels.dsa import hopper
from kiln_kernels.dsa import triton as dsa
from kiln_kernels.kda import chunk_bwd, chunk_fwd
from kiln_kernels.kda import triton as kda

TARGET = GPUTarget("cuda", 90, 32)
SMEM = 232448  # shared memory a block may have on the H100 and H200 (227 KB)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
BF, F32, I32 = "*bf16", "*fp32", "*i32"
GEMM = dict(DT=tl.bfloat16, PREC="tf32")
# kernel: (function, pointer and scalar arguments, constexprs but the launch's own)
KERNELS = {
    "intra": (
        chunk_fwd._intra,
        dict(Q=BF, Kt=BF, BETA=BF, G=F32, AQK=BF, AKK=F32, CHUNKS=I32, scale="fp32", H="i32", K="i32"),
        dict(BK=128, SPAN=80.0, **GEMM),
    ),
    "solve": (chunk_fwd._solve, dict(AKK=F32, MI=BF, CHUNKS=I32, H="i32"), {}),
    "wu": (
        chunk_fwd._wu,
        dict(Q=BF, Kt=BF, V=BF, BETA=BF, G=F32, MI=BF, W=BF, U=BF, KD=BF, QG=BF, CHUNKS=I32, scale="fp32")
        | dict(H="i32", K="i32", VD="i32"),
        GEMM,
    ),
    "states": (
        chunk_fwd._states,
        dict(KD=BF, W=BF, U=BF, G=F32, H0=F32, HS=BF, VN=BF, HT=F32, CHUNKS=I32, SEQ=I32, H="i32", K="i32")
        | dict(VD="i32"),
        dict(BK=128, HAS_H0=False, **GEMM),
    ),
    "output": (
        chunk_fwd._output,
        dict(QG=BF, AQK=BF, HS=BF, VN=BF, O=BF, CHUNKS=I32, H="i32", K="i32", VD="i32"),
        dict(BK=128, **GEMM),
    ),
    "dstates": (
        chunk_bwd._dstates,
        dict(QG=BF, KD=BF, G=F32, W=BF, AQK=BF, DO=BF, DHT=F32, DH=F32, DVN=BF, DH0=F32, CHUNKS=I32, SEQ=I32)
        | dict(H="i32", K="i32", VD="i32"),
        dict(BK=128, HAS_DHT=False, **GEMM),
    ),
    "dlocal": (
        chunk_bwd._dlocal,
        dict(Q=BF, Kt=BF, V=BF, BETA=BF, G=F32, MI=BF, VN=BF, DVN=BF, DO=BF, HS=BF, DH=F32, DQ=F32, DK=F32)
        | dict(DV=BF, DB=F32, DG=F32, DAQK=F32, DAKK=F32, CHUNKS=I32, scale="fp32", H="i32", K="i32", VD="i32"),
        dict(BK=64, **GEMM),
    ),
    "dintra": (
        chunk_bwd._dintra,
        dict(Q=BF, Kt=BF, BETA=BF, G=F32, DAQK=F32, DAKK=F32, DQ=F32, DK=F32, DBP=F32, DG=F32, DQO=BF, DKO=BF)
        | dict(CHUNKS=I32, scale="fp32", R="i32", H="i32", K="i32"),
        dict(BK=64, DT=tl.float32, PREC="tf32", SPAN=80.0),
    ),
}


MLA = dict(H=64, G=1, D=576, DA=512, DB=64, E=512, PREC="tf32")
INDEXER = dict(J=64, DH=128, DH_PAD=128, PREC="tf32")  # the lightning indexer: 64 heads of 128
ATTN = dict(Q=BF, Kk=BF, V=BF, IDX=I32, CNT=I32)
GRADS = dict(DO=BF, LSE=F32, DELTA=F32)
FWD = ATTN | dict(O=BF, LSE=F32, T="i32", NK="i32", scale2="fp32")
CHUNK = dict(t0="i32", NC="i32", TS="i32", TC="i32")  # the backward's chunk of queries
BWD = ATTN | GRADS | dict(PT=BF, DST=BF, P=F32, T="i32", NK="i32", scale2="fp32") | CHUNK
KEYS = dict(A=BF, X=BF, A2=BF, X2=BF, Kk=BF, DQ=BF, IDX=I32, CNT=I32, OUT=F32, T="i32", NK="i32", s="fp32") | CHUNK
KEYS |= dict(C0="i32", C1="i32")
KERNELS |= {
    "dsa fwd": (dsa._attn_fwd, FWD, MLA | dict(SHARED=False)),
    "dsa fwd shared": (dsa._attn_fwd, FWD, MLA | dict(SHARED=True)),  # the model's
    # the model's on Hopper (Gluon): one block of 64 heads, 64 keys a block, two warp groups split by dims
    "dsa fwd hopper": (
        hopper._fwd,
        dict(Q=BF, Kk=BF, IDX=I32, CNT=I32, O=BF, LSE=F32, T="i32", NK="i32", scale2="fp32"),
        dict(H=64, G=1, D=576, DA=512, DB=64, BH=hopper.BH, BK=hopper.BK, num_warps=hopper.WARPS),
    ),
    "dsa walk hopper": (
        hopper._walk,
        dict(Q=BF, Kk=BF, IDX=I32, CNT=I32)
        | GRADS
        | dict(PT=BF, DST=BF, P=F32, T="i32", NK="i32", scale2="fp32")
        | CHUNK,
        dict(H=64, G=1, D=576, DA=512, DB=64, HP=64, ORDERED=False, WEIGHTS=True)
        | dict(BH=hopper.BH, BK=hopper.WALK_BK, num_warps=hopper.WALK_WARPS),
    ),
    "dsa bwd": (dsa._attn_bwd, BWD, MLA | dict(E_PAD=512, HP=64, ORDERED=False, SHARED=False, WEIGHTS=False)),
    # the model's where the indexer learns: the target's shares from the same walk
    "dsa bwd shared": (dsa._attn_bwd, BWD, MLA | dict(E_PAD=512, HP=64, ORDERED=False, SHARED=True, WEIGHTS=True)),
    # the model's gradients from the walk: the keys' ds^T q + p^T do and dq's ds k (columns [0, E))
    "dsa keys": (
        dsa._key_shares,
        KEYS,
        dict(H=64, G=1, DX=576, DX2=512, W=576, HP=64, PREC="tf32", ADD=True, QGRAD=True, ORDERED=False),
    ),
    "dsa index": (
        dsa._index_keys,
        dict(Q=BF, Kx=BF, W=BF, STARTS=I32, OUT=I32, MAXES=I32, t0="i32", t1="i32", T="i32", S="i32", NG="i32")
        | dict(scale="fp32"),
        INDEXER | dict(GS=4),
    ),
    "dsa kl fwd": (
        dsa._kl_fwd,
        dict(Q=BF, Kx=BF, W=BF, IDX=I32, CNT=I32, P=F32, LOSS=F32, LSE=F32, PSUM=F32, T="i32", NK="i32", scale="fp32"),
        INDEXER | dict(J_PAD=64),
    ),
    "dsa kl bwd": (
        dsa._kl_bwd,
        dict(Q=BF, Kx=BF, W=BF, IDX=I32, CNT=I32, P=F32, LSE=F32, PSUM=F32, GRAD=F32, DQ=BF, DK=F32, DW=BF)
        | dict(T="i32", NK="i32", scale="fp32", inv_B="fp32", t0="i32", TC="i32"),
        INDEXER | dict(J_PAD=64, ORDERED=False),
    ),
}


def settings(kernel: str, tune: bool) -> list[dict]:
    """The kernel's launch settings today (its module's CONFIG), then its bench's candidates."""
    if kernel.endswith(" hopper"):  # fixed settings (its KERNELS entry)
        return [dict(num_warps=KERNELS[kernel][2]["num_warps"])]
    name = kernel.removeprefix("dsa ")
    config, candidates = (dsa.CONFIG, dsa_bench.CANDIDATES) if kernel != name else (kda.CONFIG, kda_bench.CANDIDATES)
    name = name if name in config else name.removesuffix(" shared")
    found = [config[name]] + ([c for c in candidates.get(name, []) if c != config[name]] if tune else [])
    if kernel == "dsa fwd shared":  # the values from the key tile: one value block, E wide
        wide = [{**c, "EB": 512} for c in found]
        found = [c for i, c in enumerate(wide) if c not in wide[:i]]
    return found


def aligned(fn, args: dict) -> dict:
    """The hints Triton's launcher gives a compile at run time (its "D" specialisation): every
    pointer 16-byte aligned (torch's allocations are) and every integer argument a multiple of 16
    (Kimi Linear's H, K and V are). Without them no load is vectorised or pipelined (cp.async),
    and the registers counted are another kernel's."""
    hinted = [n for n, t in args.items() if t.startswith("*") or t == "i32"]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}


def usage(kernel: str, launch: dict) -> str:
    fn, args, fixed = KERNELS[kernel]
    constexprs = {  # a parameter's default where neither sets it (unbound, it would compile as None)
        **{n: p.default for n, p in inspect.signature(fn.fn).parameters.items() if p.default is not p.empty},
        **fixed,
        **{k: v for k, v in launch.items() if k not in ("num_warps", "num_stages")},
    }
    options = {k: launch[k] for k in ("num_warps", "num_stages") if k in launch}
    src = (GluonASTSource if fn.is_gluon() else ASTSource)(
        fn=fn,
        signature={**args, **{k: "constexpr" for k in constexprs}},
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=aligned(fn, args),
    )
    compiled = triton.compile(src, target=TARGET, options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True)
    text = out.stderr.decode()
    ttgir = compiled.asm["ttgir"]
    regs = re.search(r"Used (\d+) registers", text)
    # the most buffers of any 2-D tile the pipeline copies into (the module's docstring)
    depth = max((int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+x", ttgir)), default=0)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    smem = compiled.metadata.shared
    return (
        f"{regs.group(1) if regs else '?'} registers, "
        + (f"spills {spills.group(1)} B stored, {spills.group(2)} B loaded" if spills else "no spill line")
        + f", {ttgir.count('async_copy_global_to_local')} async copies"
        + (f" ({depth} buffers a tile)" if depth else "")
        + (", wgmma" if "warp_group_dot" in ttgir else "")
        + (", wgmma serialised (ptxas C7514)" if "C7514" in text else "")
        + f", {smem // 1024} KB shared"
        + (" (over the 227 KB a block may have: fails at launch)" if smem > SMEM else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernels", nargs="*", metavar="KERNEL", help="these only (names as printed)")
    ap.add_argument("--tune", action="store_true", help="bench.kda's and bench.dsa's candidate settings too")
    a = ap.parse_args()
    for kernel in a.kernels or KERNELS:
        for launch in settings(kernel, a.tune):
            print(f"{kernel} {launch}: {usage(kernel, launch)}", flush=True)


if __name__ == "__main__":
    main()
