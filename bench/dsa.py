"""Gated DSA at long sequences (issue #31's bench): the Triton path (kiln_kernels/dsa/triton.py),
its parts timed apart, against dense causal FlashAttention (torch SDPA) at the same length, in
one run.

    python3 -m bench.dsa           # T = 8k..128k, top-k 2048, MLA absorbed: H 64, D 576, E 512, bf16
    python3 -m bench.dsa --tune    # other settings of each kernel (--tune bwd: of those named), at the first --seq

A row per T: the lightning indexer's scores and top-k (64 index heads of 128; forward only, it
has no gradient) ``topk_ms``; the sparse attention's forward (as training runs it, with the
indexer's inputs) and its backward (gradients of q and of the shared latent rows) timed apart,
as TFLOP/s: 2 T H K (D + E) forward and 2.5x that backward, K the selected keys a query;
``loss_ms``: what the indexer's KL loss adds to the training backward (the target's shares in
the attention's walk, the loss's forward and backward: ``train_bwd_ms`` - ``bwd_ms``); the whole
DSA layer (``dsa_ms``: top-k, forward, training backward) against dense causal SDPA forward +
backward in MLA's plain form (H heads of qk 192, v 128) at the same T, ``dense_ms``. Median of
3 timed calls after 1 (a backward: its forward untimed before each call). The gather
path of earlier sessions (PyTorch's small ops) is in bench/RESULTS.md's history, not timed here.
``--previous PATH`` (an earlier copy of kiln_kernels/dsa/triton.py, e.g. ``git show
REV:kiln_kernels/dsa/triton.py > .dev/prev.py``, or of the whole folder with its Gluon kernels,
``mkdir -p .dev/prev && git archive REV kiln_kernels/dsa | tar -x -C .dev/prev``, then
``--previous .dev/prev/kiln_kernels/dsa``): its top-k, attention forward and backward timed
in the same run at each T, ``prev_topk_ms`` / ``prev_fwd_ms`` (its training forward: before
2026-12-07 the kernels took ``with_weights`` and walked the keys twice for the target) /
``prev_bwd_ms``; the share of its
index entries that are today's (``prev_topk_same``: 1 but for near-ties, summed in another order),
and the largest difference of its output and gradients from today's (``prev_rel``: relative, the
worst of o, dq, dkv).
Writes bench/results/dsa.json: ``{"rows": [{"T", "fwd_tflops", "bwd_tflops", "topk_ms", "dsa_ms",
"dense_ms", ...}], "device", "date", ...}``, keeping the file's earlier runs (its keys that hold a
dict; another device's table moved under a key of its own, ``cuda_time.carried``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.cuda_time import DEV, carried, median_ms, sweep
from engine import device as accelerator
from kiln_kernels.dsa import triton as fused


def timed(fn) -> float:
    return median_ms(fn, reps=3, warmup=1)


# each kernel's settings tried by --tune, each timed by the op that runs it (``tune``)
CANDIDATES: dict[str, list[dict[str, Any]]] = {
    "index": [  # the top-k (its scoring kernel's tile)
        dict(BM=64, BN=128, num_warps=4, num_stages=3),
        dict(BM=64, BN=128, num_warps=4, num_stages=2),
        dict(BM=64, BN=256, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, num_warps=8, num_stages=3),
    ],
    "topk": [  # the k-th best key through the groups' bound (GS keys a group), or (share 0) in whole rows
        dict(GS=4, share=0.75),
        dict(GS=2, share=0.75),
        dict(GS=8, share=0.75),
        dict(GS=4, share=0.0),
    ],
    "kl fwd": [dict(BK=32, num_warps=4), dict(BK=16, num_warps=4), dict(BK=64, num_warps=4)],
    "kl bwd": [dict(BK=64, num_warps=4), dict(BK=64, num_warps=8), dict(BK=32, num_warps=8), dict(BK=32, num_warps=4)],
    "fwd shared": [  # the model's values are the keys' first dims: one value block, EB = E, always
        dict(BH=64, EB=512, BK=64, num_warps=8),
        dict(BH=64, EB=512, BK=32, num_warps=8),
        dict(BH=64, EB=512, BK=64, num_warps=4),
        dict(BH=32, EB=512, BK=64, num_warps=8),
    ],
    "bwd shared": [  # the model's
        dict(BH=64, BK=64, num_warps=8, num_stages=1),
        dict(BH=64, BK=32, num_warps=8, num_stages=2),
        dict(BH=64, BK=32, num_warps=8, num_stages=1),
        dict(BH=64, BK=64, num_warps=4, num_stages=1),
    ],
    "keys": [
        dict(NT=128, BK=128, num_warps=8),
        dict(NT=64, BK=128, num_warps=8),
        dict(NT=128, BK=128, num_warps=8, num_stages=2),
        dict(NT=64, BK=64, num_warps=4),
        dict(NT=128, BK=64, num_warps=4),
    ],
}


def tune(a) -> None:
    """Each kernel's candidate settings at the first --seq, the others at their defaults, timed by
    the op that runs it: the top-k (``index``, ``topk``), the attention's forward alone (``fwd
    shared``), the whole attention (forward with the target, and backward: ``bwd shared``,
    ``keys``), the KL loss forward and backward (``kl fwd``, ``kl bwd``)."""
    T, H, D, E = a.seq[0], a.heads, 576, 512
    bf: dict[str, Any] = dict(device=DEV, dtype=torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    qi = torch.randn(1, T, a.index_heads, 128, generator=g, **bf).requires_grad_()
    ki = torch.randn(1, T, 128, generator=g, **bf).requires_grad_()
    w = (torch.randn(1, T, a.index_heads, generator=g, **bf) * a.index_heads**-0.5).requires_grad_()
    starts = torch.zeros(1, T, dtype=torch.long, device=DEV)
    q = torch.randn(1, T, H, D, generator=g, **bf).requires_grad_()
    kv = torch.randn(1, T, 1, D, generator=g, **bf).requires_grad_()
    do = torch.randn(1, T, H, E, generator=g, **bf)

    def topk():
        return fused.indexer_topk(qi.detach(), ki.detach(), w.detach(), starts, a.topk)

    idx = topk()
    target = random_target(idx, g)

    def attn():
        o, loss = fused.sparse_attention(q, kv, kv[..., :E], idx, 0.07, (qi, ki, w))
        torch.autograd.backward([o, loss], [do, torch.ones_like(loss)])

    @torch.no_grad()
    def forward():
        fused.sparse_attention(q, kv, kv[..., :E], idx, 0.07)

    ops = {"index": topk, "topk": topk, "fwd shared": forward, "bwd shared": attn, "keys": attn}
    ops |= dict.fromkeys(["kl fwd", "kl bwd"], lambda: fused.indexer_kl_loss(qi, ki, w, idx, target).backward())
    fastest: dict[str, dict] = {}
    for name, cands in CANDIDATES.items():
        if a.tune and name not in a.tune:
            continue
        if name == "fwd shared" and fused._hopper_forward(fused._attn_meta(q, kv, kv[..., :E])[0], q, kv):
            print("fwd shared: the Gluon forward runs here (kiln_kernels/dsa/hopper.py), not these", flush=True)
            continue

        def timing(op=ops[name]) -> tuple[str, float]:
            ms = timed(op)
            return f"{ms:.1f} ms", ms

        fastest |= sweep(fused.CONFIG, {name: cands}, timing)
    print(f"fastest: {fastest}", flush=True)


def random_target(idx: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A target for the KL loss timed alone: random probabilities on each query's selected keys."""
    logits = torch.randn(idx.shape, device=idx.device, generator=g).masked_fill(idx < 0, float("-inf"))
    return torch.softmax(logits, -1)


def training_attention(module, args: tuple, indexer: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention as training runs it, with the indexer's target: kernels before 2026-12-07
    took ``with_weights`` (the target written by the forward), today's the indexer's inputs (the
    target and the KL loss in the backward)."""
    if "with_weights" in inspect.signature(module.sparse_attention).parameters:
        return module.sparse_attention(*args, True)
    return module.sparse_attention(*args, indexer)


def dims(a) -> tuple[int, int, int, int, int, int]:
    """H query heads, D the absorbed query/key width, E the value width, J index heads of Dh, rope."""
    return a.heads, 576, 512, a.index_heads, 128, 64


def backward_ms(forward, grads: list[torch.Tensor], reps: int = 3) -> float:
    """The median time of a backward alone of ``forward()``'s outputs (a list, ``grads`` theirs),
    each from a fresh forward run untimed before it."""
    torch.autograd.backward(forward(), grads)
    times = []
    for _ in range(reps):
        fresh = forward()
        times.append(accelerator.elapsed_ms(DEV, lambda: torch.autograd.backward(fresh, grads)))  # noqa: B023
    return statistics.median(times)


class _Renamed(importlib.machinery.SourceFileLoader):
    """A module of a previous copy of kiln_kernels/dsa, its imports of that package pointed at
    the copy (``previous_dsa``): the copy's triton.py runs the copy's own Gluon kernels. Compiled
    from its source every time: neither read from nor written to a bytecode cache, where the
    copy's or the package's own (unrenamed) code may be."""

    def get_code(self, fullname):
        source = self.get_data(self.path).replace(b"kiln_kernels.dsa", b"previous_dsa")
        return compile(source, self.path, "exec", dont_inherit=True)


class _Previous(importlib.abc.MetaPathFinder):
    """Finds ``previous_dsa``'s modules in the copy's folder (the package itself is an empty
    one, made by ``load_previous``)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        file = self.folder / (name.removeprefix("previous_dsa.") + ".py")
        if not name.startswith("previous_dsa.") or not file.is_file():
            return None
        return importlib.util.spec_from_file_location(name, file, loader=_Renamed(name, str(file)))


def load_previous(path: Path | None):
    """An earlier copy of the DSA kernels (None: none): a copy of kiln_kernels/dsa/triton.py
    alone, run anew on each call (its Gluon kernels, if it takes any, today's), or of the whole
    kiln_kernels/dsa folder (``git archive REV kiln_kernels/dsa | tar -x -C DIR``, then
    DIR/kiln_kernels/dsa), whose triton.py is imported once a process as ``previous_dsa.triton``
    with the copy's own hopper.py and reference.py (one folder a process)."""
    if path is None:
        return None
    if path.is_dir():
        folder = path.resolve()
        if not (folder / "triton.py").is_file():
            raise ValueError(f"{path} holds no triton.py: give the copy's kiln_kernels/dsa folder")
        finders = [f for f in sys.meta_path if isinstance(f, _Previous)]
        if finders and finders[0].folder != folder:
            raise ValueError(f"one previous copy a process: {finders[0].folder} is loaded, not {folder}")
        if not finders:  # the package empty: the copy's __init__.py would register the kernels'
            # torch ops again over today's, and its functions dispatch to today's modules anyway
            package = importlib.machinery.ModuleSpec("previous_dsa", None, is_package=True)
            package.submodule_search_locations = [str(folder)]
            sys.modules["previous_dsa"] = importlib.util.module_from_spec(package)
            sys.meta_path.insert(0, _Previous(folder))
        return importlib.import_module("previous_dsa.triton")
    spec = importlib.util.spec_from_file_location("previous_dsa_triton", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def against_previous(prev, args: tuple, indexer: tuple, do: torch.Tensor, leaves: list[torch.Tensor], topk) -> dict:
    """The previous kernels on the same inputs: their times; how far their attention's output and
    gradients are from today's (relative, the worst of the three); the share of their top-k's
    index entries that are today's (``topk``: today's top-k, a function of the module)."""

    def grads(module):
        for x in leaves:
            x.grad = None
        o = training_attention(module, args, indexer)[0]
        o.backward(do)
        return [o.detach().float()] + [x.grad.float() for x in leaves]

    now, then = grads(fused), grads(prev)
    for x in leaves:
        x.grad = None
    return {
        "prev_topk_ms": timed(lambda: topk(prev)),
        "prev_topk_same": float((topk(prev) == topk(fused)).float().mean()),
        "prev_fwd_ms": timed(lambda: training_attention(prev, args, indexer)),
        "prev_bwd_ms": backward_ms(lambda: [training_attention(prev, args, indexer)[0]], [do]),
        "prev_rel": max(float((a - b).norm() / b.norm()) for a, b in zip(now, then, strict=True)),
    }


def measure(a, T: int, prev=None) -> dict:
    """One length's row (printed as it goes). Its tensors are this call's locals, freed when it
    returns. ``prev``: the previous kernels' module, timed too."""
    H, D, E, J, Dh, rope = dims(a)
    bf: dict[str, Any] = dict(device=DEV, dtype=torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    qi = torch.randn(T, J, Dh, generator=g, **bf).requires_grad_()
    ki = torch.randn(T, Dh, generator=g, **bf).requires_grad_()
    w = (torch.randn(T, J, generator=g, **bf) * J**-0.5).requires_grad_()
    q = torch.randn(T, H, D, generator=g, **bf).requires_grad_()
    kv = torch.randn(T, D, generator=g, **bf).requires_grad_()
    do = torch.randn(1, T, H, E, generator=g, **bf)
    scale = (128 + rope) ** -0.5
    starts = torch.zeros(1, T, dtype=torch.long, device=DEV)

    def topk(module=fused):
        return module.indexer_topk(qi[None].detach(), ki[None].detach(), w[None].detach(), starts, a.topk)

    idx = topk()

    inputs = (q[None], kv[None, :, None], kv[None, :, None, :E], idx, scale)
    indexer = (qi[None], ki[None], w[None])

    def attention():
        return list(fused.sparse_attention(*inputs, indexer))

    one = torch.ones((), device=DEV)
    ms = {
        "topk_ms": timed(topk),
        "fwd_ms": timed(attention),
        "bwd_ms": backward_ms(lambda: attention()[:1], [do]),  # the output's alone: no target, no loss
        "train_bwd_ms": backward_ms(attention, [do, one]),
    }
    ms["loss_ms"] = ms["train_bwd_ms"] - ms["bwd_ms"]
    if prev is not None:
        ms.update(against_previous(prev, inputs, indexer, do, [q, kv], topk))
    qd = torch.randn(1, H, T, 192, generator=g, **bf).requires_grad_()
    kd = torch.randn(1, H, T, 192, generator=g, **bf).requires_grad_()
    vd = torch.randn(1, H, T, 128, generator=g, **bf).requires_grad_()
    dod = torch.randn(1, H, T, 128, generator=g, **bf)
    dense = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(dod))
    keys = float((idx >= 0).sum()) / T
    flops = 2 * T * H * keys * (D + E)  # the forward's; the backward's 2.5x
    dsa = ms["topk_ms"] + ms["fwd_ms"] + ms["train_bwd_ms"]
    row = {
        "T": T,
        "fwd_tflops": flops / ms["fwd_ms"] / 1e9,
        "bwd_tflops": 2.5 * flops / ms["bwd_ms"] / 1e9,
        **ms,
        "dsa_ms": dsa,
        "dense_ms": dense,
        "dsa_vs_dense": dense / dsa,
    }
    print(
        f"| {T} | {ms['topk_ms']:.1f} | {ms['fwd_ms']:.1f} ({row['fwd_tflops']:.0f}) | "
        f"{ms['bwd_ms']:.1f} ({row['bwd_tflops']:.0f}) | {ms['loss_ms']:.1f} | {dsa:.1f} | {dense:.1f} | "
        f"{row['dsa_vs_dense']:.2f}x |",
        flush=True,
    )
    if prev is not None:
        print(
            f"  previous kernels: top-k {ms['prev_topk_ms']:.1f} ms ({ms['prev_topk_same']:.4f} of its entries "
            f"today's), fwd {ms['prev_fwd_ms']:.1f} ms, bwd {ms['prev_bwd_ms']:.1f} ms (today's at "
            f"{ms['prev_fwd_ms'] / ms['fwd_ms']:.2f}x and {ms['prev_bwd_ms'] / ms['bwd_ms']:.2f}x their speed); "
            f"outputs and gradients within {ms['prev_rel']:.1e} of theirs",
            flush=True,
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--out", default="bench/results/dsa.json")
    ap.add_argument(
        "--tune", nargs="*", metavar="KERNEL", help="time other settings of each kernel (or of those named) instead"
    )
    ap.add_argument(
        "--previous",
        type=Path,
        default=None,
        help="an earlier copy of kiln_kernels/dsa/triton.py or of its folder, timed too",
    )
    a = ap.parse_args()
    if a.tune is not None:
        return tune(a)
    H, D, E, J, Dh, _ = dims(a)
    print(
        f"{accelerator.name(DEV)}, torch {torch.__version__}; H={H}, D={D}, E={E}, index {J}x{Dh}, top-{a.topk}, bf16"
    )
    print(
        "| T | top-k ms | attention fwd ms (TFLOP/s) | bwd ms (TFLOP/s) | KL loss ms | DSA ms | dense ms | dense/DSA |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows: list[dict] = []
    prev = load_previous(a.previous)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the file's earlier runs, each under its key (another device's table moved under one), not
    # the notes of the table this run replaces
    earlier = carried(json.loads(out.read_text()) if out.exists() else {}, accelerator.name(DEV))
    done: dict[str, Any] = {k: v for k, v in earlier.items() if isinstance(v, dict)}
    done |= {
        "command": "python3 -m bench.dsa " + " ".join(sys.argv[1:]),
        "device": accelerator.name(DEV),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "heads": H,
        "dims": [D, E],
        "index": [J, Dh],
        "topk": a.topk,
        "rows": rows,
    }
    for T in a.seq:  # written after each length: a later one running out of memory keeps the rows before
        rows.append(measure(a, T, prev))
        out.write_text(json.dumps(done, indent=2))
        accelerator.empty_cache(DEV)


if __name__ == "__main__":
    main()
