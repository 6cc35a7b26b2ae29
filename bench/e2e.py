"""The whole LoRA training step on a Kimi-Linear-48B-shaped model: Kiln against what a user would
pick instead, Hugging Face transformers + PEFT (+ fla-core's KDA kernels, its wheel carried),
same checkpoint, same tokens per step.

    python3 -m bench.e2e --side kiln    # then, on the same machine, --side hf (or --side both)

The checkpoint: transformers' ``KimiLinearForCausalLM`` at Kimi-Linear-48B-A3B's layer shapes
(hidden 2304, KDA 32 x 128, MLA 32 heads q/k 192 v 128, 256 experts of 1024 top-8 + 1 shared,
vocab 163840), 5 layers (KDA, KDA, KDA, MLA, KDA; the first MLP dense), random weights, saved by
transformers in bf16 to ``--ckpt`` once and loaded from there by both sides: Kiln through
``engine.model.registry.load_base`` as the trainer loads it, transformers through ``from_pretrained``.
LoRA rank 16 (alpha 32) on q/k/v/o and the MLPs' gate/up/down projections, and with
``experts`` on every expert's gate_up/down too (PEFT's ``target_parameters``); fused AdamW
(transformers' Trainer's default; Kiln's trainer's, its update skipped on the device where the
gradient norm is not finite), the gradients clipped to norm 1 by both.

Each row: ``tokens`` per step as one document (``single``) or documents of 4096 (``packed4k``:
Kiln packs them into one row as its trainer does, transformers takes them as a batch of rows);
``--steps`` timed steps after the first (the first, with its compiles and autotuning, is
reported apart as ``first_step_s``, with its Triton compiles: how many, their summed time and
the slowest, ``first_step_compiles``); tokens/s from the median step; peak memory
(the device's ``max_memory_allocated``, weights included) over the timed steps. Rows over LONG
tokens run with each side's memory saving on (Kiln: Swap Core's selective recompute, keeping
the kernels' outputs or ``--kiln-cache``'s op classes; transformers: gradient checkpointing);
a shorter row that runs out of memory without it runs again with it, as a user would turn it on
(the row's ``memory``). Then one more step
under the torch profiler, its GPU time split by op class (``CLASSES``): the forward's ops by the
module they run in, the backward's by the forward op that made them (autograd's sequence
numbers), ``host gaps`` = the step's wall time the GPU was idle. ``--memory-breakdown`` (CUDA):
one more step under the allocator's history, what is alive at its peak by allocation site
(``peak_breakdown_gib``).

Writes (merging with what the other side wrote) bench/results/e2e.json as
``{"rows": [{"tokens", "layout", "experts", "kiln_tokens_per_s", "kiln_peak_gib",
"hf_tokens_per_s", "hf_peak_gib", "kiln_first_step_s", ...}], "device", "date"}``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import logging
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.cuda_time import carried, default_device
from engine import device as accelerator
from kiln_kernels import ahead

SHAPE: dict[str, Any] = dict(
    vocab_size=163840,
    hidden_size=2304,
    intermediate_size=9216,
    moe_intermediate_size=1024,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_local_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    linear_head_dim=128,
    linear_num_heads=32,
    routed_scaling_factor=2.446,
    layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
    mlp_layer_types=["dense"] + ["sparse"] * 4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# --check: the whole script at a tiny size on the CPU, in seconds (no timings worth reading)
TINY = dict(
    SHAPE,
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    linear_head_dim=16,
    linear_num_heads=4,
)
DOC = 4096
LONG = 16384  # longer rows (32k and up): Kiln recomputes (Swap Core), transformers checkpoints its layers (run_side)
KILN_CACHE = ["kernels"]  # what Kiln's recompute keeps on the long rows (MemorySpec.cache_ops; --kiln-cache)
DEV = default_device()  # CUDA, else an Ascend NPU (--check: the CPU)
TAG = "e2e::"
# a row's keys before either side has run (the issue's shape: null where a side has no number)
EMPTY_ROW = dict(
    kiln_tokens_per_s=None, kiln_peak_gib=None, hf_tokens_per_s=None, hf_peak_gib=None, kiln_first_step_s=None
)
CLASSES = ["KDA", "attention", "MoE", "projections + LoRA", "loss", "optimizer", "other"]


# --------------------------------------------------------------------------------------------
# where the time goes


def tag_modules(model: nn.Module, classes: dict[type, str]) -> list:
    """Forward hooks that open a profiler range ``e2e::<class>`` around every module of a tagged
    type (the innermost range wins: a LoRA projection inside a KDA layer counts as projections)."""
    handles = []
    for m in model.modules():
        cls = next((c for t, c in classes.items() if isinstance(m, t)), None)
        if cls is None:
            continue

        def pre(mod, args, cls=cls):  # a stack: a module may carry two tags (the head: projection, loss)
            mod.__dict__.setdefault("_e2e_ranges", []).append(torch.profiler.record_function(TAG + cls))
            mod._e2e_ranges[-1].__enter__()

        def post(mod, args, out):
            mod._e2e_ranges.pop().__exit__(None, None, None)

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


class _Patch:
    """Wrap ``owner.attr`` (a function) in a profiler range of ``cls`` until ``remove``."""

    def __init__(self, owner, attr: str, cls: str):
        self.owner, self.attr, self.fn = owner, attr, getattr(owner, attr)

        def wrapped(*args, **kw):
            with torch.profiler.record_function(TAG + cls):
                return self.fn(*args, **kw)

        setattr(owner, attr, wrapped)

    def remove(self) -> None:
        setattr(self.owner, self.attr, self.fn)


NAME_HINTS = [
    ("kda", "KDA"),
    ("conv", "KDA"),
    ("_intra", "KDA"),
    ("_solve", "KDA"),
    ("_wu", "KDA"),
    ("_states", "KDA"),
    ("_dlocal", "KDA"),
    ("_output", "KDA"),
    ("_cumsum", "KDA"),
    ("chunk_", "KDA"),
    ("flash", "attention"),
    ("fmha", "attention"),
    ("attention", "attention"),
    ("experts", "MoE"),
    ("grouped", "MoE"),
    ("lora", "projections + LoRA"),
    ("crossentropy", "loss"),
    ("cross_entropy", "loss"),
    ("adam", "optimizer"),
]


def split_by_class(prof, wall_ms: float) -> dict[str, float]:
    """GPU ms of one profiled step by op class, and the host gaps."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    by_seq: dict[tuple, str] = {}

    def tagged(e):
        while e is not None:
            if e.name.startswith(TAG):
                return e.name[len(TAG) :]
            e = e.cpu_parent
        return None

    for e in events:  # the forward: an op's class is its innermost tagged range
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            c = tagged(e)
            if c is not None:
                by_seq.setdefault((e.thread, e.sequence_nr), c)

    def resolve(e):
        while e is not None:
            if e.name.startswith(TAG):
                return e.name[len(TAG) :]
            if e.name.startswith("autograd::engine::evaluate_function"):  # the backward: its forward op's class
                c = by_seq.get((e.fwd_thread, e.sequence_nr))
                if c is not None:
                    return c
            e = e.cpu_parent
        return None

    split: dict[str, float] = defaultdict(float)
    busy = []
    for e in events:  # on the CPU (--check) each op's own time stands for its kernels
        work = (
            [(k.name, k.duration) for k in e.kernels]
            if DEV.type == "cuda"
            else ([(e.name, e.self_cpu_time_total)] if not e.name.startswith(TAG) else [])
        )
        for name, us in work:
            c = resolve(e)
            if c is None:
                low = (name + " " + e.name).lower()
                c = next((cls for hint, cls in NAME_HINTS if hint in low), "other")
            split[c] += us / 1e3
    for e in prof.events():
        if e.device_type.name == "CUDA":
            busy.append((e.time_range.start, e.time_range.end))
    busy.sort()
    total, end = 0.0, -1.0
    for a, b in busy:  # the union of kernel intervals: the time the GPU worked
        if b > end:
            total += b - max(a, end)
            end = b
    out = {c: round(split.get(c, 0.0), 2) for c in CLASSES}
    out["gpu busy"] = round(total / 1e3, 2)
    out["host gaps"] = round(max(0.0, wall_ms - total / 1e3), 2)
    return out


# --------------------------------------------------------------------------------------------
# the two sides


def sync() -> None:
    accelerator.synchronize(DEV)


def reset_peak() -> None:
    accelerator.reset_peak(DEV)


def peak_gib() -> float:
    return accelerator.max_allocated(DEV) / 2**30


def free() -> None:
    gc.collect()
    accelerator.empty_cache(DEV)


def device_name() -> str:
    return accelerator.name(DEV)


class Compiles:
    """Triton's compiles while it is on (its compilation listener): how many, their summed time
    (the host's: a first step waits on each in turn) and the slowest, for the first step's split;
    and how many kernels were read from Triton's cache on disk instead (an earlier run's: a first
    step with any is not a cold one)."""

    def __init__(self):
        self.times: dict[str, float] = defaultdict(float)
        self.count = self.cached = 0
        self.at_launch: list[str] = []  # compiled where a kernel launched, not ahead in the compile threads

    def __enter__(self):
        try:
            from triton import knobs
        except ImportError:  # the CPU check runs without triton
            return self
        self._knobs = knobs

        def listen(src, metadata, metadata_group, times, cache_hit):
            self.cached += cache_hit
            if not cache_hit:
                name = getattr(getattr(src, "fn", None), "__name__", "?")
                self.count += 1
                self.times[name] += times.total / 1e6
                if not threading.current_thread().name.startswith(ahead.THREADS):
                    self.at_launch.append(name)

        knobs.compilation.listener = listen
        return self

    def __exit__(self, *exc):
        if hasattr(self, "_knobs"):
            self._knobs.compilation.listener = None

    def report(self) -> dict:
        top = sorted(self.times.items(), key=lambda kv: -kv[1])[:8]
        return {
            "compiles": self.count,
            "read_from_cache": self.cached,
            "compile_s": sum(self.times.values()),
            "slowest_compiles_s": {k: round(v, 2) for k, v in top},
            "compiled_at_launch": dict(Counter(self.at_launch)),  # kernel: how many of its compiles
        }


def peak_breakdown(step, top: int = 12) -> dict[str, float]:
    """GiB alive at one step's peak by where they were allocated (the innermost three engine /
    kiln_kernels frames), from the CUDA allocator's history of that step replayed to its peak
    (above what was alive before it: the weights, the optimizer's state)."""
    cuda = torch.cuda
    cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        sync()
        trace = cuda.memory._snapshot()["device_traces"][cuda.current_device()]
    finally:
        cuda.memory._record_memory_history(enabled=None)
    cur = best = 0
    at = -1
    sizes: dict[int, int] = {}
    for i, ev in enumerate(trace):  # where the peak falls
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            cur += ev["size"]
            if cur > best:
                best, at = cur, i
        elif ev["action"] == "free_completed" and ev["addr"] in sizes:
            cur -= sizes.pop(ev["addr"])
    alive: dict[int, dict] = {}
    for ev in trace[: at + 1]:  # what is alive there
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)

    def where(ev: dict) -> str:
        ours = [f for f in ev.get("frames", []) if "engine/" in f["filename"] or "kiln_kernels/" in f["filename"]]
        return " <- ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in ours[:3]) or "?"

    groups: dict[str, float] = defaultdict(float)
    for ev in alive.values():
        groups[where(ev)] += ev["size"] / 2**30
    return {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:top]}


def build_checkpoint(folder: Path) -> None:
    import transformers

    if (folder / "config.json").exists():
        return
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with DEV:
        model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**SHAPE))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    del model
    free()
    print(f"checkpoint built and saved in {time.perf_counter() - t0:.0f} s: {folder}", flush=True)


def batch_of(tokens: int, layout: str, seed: int) -> list[torch.Tensor]:
    """The step's documents: random token ids (every next token a target)."""
    g = torch.Generator().manual_seed(seed)
    doc = tokens if layout == "single" else DOC
    return [torch.randint(3, SHAPE["vocab_size"], (doc,), generator=g) for _ in range(tokens // doc)]


class Kiln:
    name = "kiln"

    def __init__(self, folder: Path, experts: bool):
        from engine.lora import apply_lora, store_frozen
        from engine.model.registry import load_base
        from engine.training.optim import optimizer
        from kiln.spec import LoraSpec
        from kiln_kernels.ahead import start_compilers

        t0 = time.perf_counter()
        if accelerator.accelerated(DEV):  # as the trainer: the first step's compile processes
            start_compilers()  # start while the checkpoint loads
        self.model: Any = load_base(folder)
        apply_lora(
            self.model,
            LoraSpec(rank=16, alpha=32, target_modules=TARGETS, target_parameters=EXPERTS if experts else []),
        )
        if accelerator.accelerated(DEV):  # as the trainer: the steps run under bf16 autocast
            store_frozen(self.model, torch.bfloat16)
        self.model.to(DEV).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = optimizer(self.params, 1e-5)  # the trainer's
        self.load_s = time.perf_counter() - t0
        self.memory = "none"
        self.rehearsed = False

    def long_mode(self, on: bool) -> None:
        """Swap Core's selective recompute for the long rows (its default keeps the kernels'
        outputs on the device; ``KILN_CACHE``), none for the others."""
        from engine.memory import apply_swap_core
        from kiln.spec import MemorySpec

        for layer in self.model.model.layers:  # undo: the wrapped forwards live on the instances
            for block in (layer.self_attn, layer.mlp):
                block.__dict__.pop("forward", None)
        self.memory = (
            ("selective" if KILN_CACHE == ["kernels"] else f"selective ({', '.join(KILN_CACHE)})") if on else "none"
        )
        if on:
            apply_swap_core(self.model, MemorySpec.model_validate({"recompute": "selective", "cache_ops": KILN_CACHE}))

    def tag(self) -> list:
        import engine.model.common.layers as layers
        from engine.lora import ExpertsLoRA, LoRALinear
        from engine.model.common.moe import MoE
        from engine.model.kimi_linear import KimiDeltaAttention, MLAttention

        return tag_modules(
            self.model,
            {
                LoRALinear: "projections + LoRA",
                nn.Linear: "projections + LoRA",
                ExpertsLoRA: "MoE",
                KimiDeltaAttention: "KDA",
                MLAttention: "attention",
                MoE: "MoE",
            },
        ) + [_Patch(layers, "next_token_loss", "loss")]

    def step(self, docs: list[torch.Tensor]) -> None:
        from engine.data import Sample
        from engine.training.optim import update
        from engine.training.ranks import Single
        from engine.training.step import accumulate

        samples = [Sample(i, d, d.clone(), torch.zeros(0, 3, 1, 1)) for i, d in enumerate(docs)]
        ranks = Single(DEV)
        loss = accumulate(self.model, samples, 1, 0, sum(len(d) for d in docs), ranks, ahead=not self.rehearsed)[0]
        self.rehearsed = True  # as the trainer: its first step compiles the kernels side by side
        with torch.profiler.record_function(TAG + "optimizer"):
            update(self.opt, self.params, ranks)  # as the trainer: nothing read before the update is queued
            self.opt.zero_grad(set_to_none=True)
        float(loss)  # as the trainer's metrics, after the update


class HF:
    name = "hf"

    def __init__(self, folder: Path, experts: bool):
        import peft
        import transformers

        t0 = time.perf_counter()
        base = transformers.KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        base = base.to(DEV)  # type: ignore[arg-type]  # transformers types its wrapped .to as unbound
        cfg = peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=TARGETS, target_parameters=EXPERTS if experts else None
        )
        self.model = peft.get_peft_model(base, cfg).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # as Kiln's (engine.training.optim): fused where it can be (the Trainer's default, adamw_torch_fused), no decay
        self.opt = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.0, fused=DEV.type in ("cpu", "cuda") or None)
        self.load_s = time.perf_counter() - t0
        self.memory = "none"

    def long_mode(self, on: bool) -> None:
        """Gradient checkpointing for the long rows, as a user would turn it on."""
        if on:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        else:
            self.model.gradient_checkpointing_disable()
        self.memory = "gradient checkpointing" if on else "none"

    def tag(self) -> list:
        import peft
        from transformers.models.kimi_linear import modeling_kimi_linear as m

        classes = {peft.tuners.lora.LoraLayer: "projections + LoRA", nn.Linear: "projections + LoRA"}
        for cls_name, c in (
            ("KimiLinearDeltaAttention", "KDA"),
            ("KimiLinearAttention", "attention"),
            ("KimiLinearMoE", "MoE"),
        ):
            classes[getattr(m, cls_name)] = c
        handles = tag_modules(self.model, classes)
        head = self.model.get_output_embeddings()
        handles += tag_modules(head, {type(head): "loss"})
        base = self.model.get_base_model()
        base.loss_function = base.loss_function  # its own attribute, so the patch can wrap and restore it
        return handles + [_Patch(base, "loss_function", "loss")]

    def step(self, docs: list[torch.Tensor]) -> None:
        ids = torch.stack(docs).to(DEV)
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        with torch.profiler.record_function(TAG + "optimizer"):
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def measure(
    side, docs: list[torch.Tensor], steps: int, profile: bool, trace_file: str | None, breakdown: bool, name: str
) -> dict:
    """One row on ``side`` as it is set (its memory mode): the first step, ``steps`` timed steps,
    then the profiled step (into ``trace_file`` under ``name``) and the peak's breakdown where asked."""
    T = sum(len(d) for d in docs)
    sync()
    t0 = time.perf_counter()
    with Compiles() as compiles:
        side.step(docs)
        sync()
    first = time.perf_counter() - t0
    reset_peak()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        side.step(docs)
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    res = {
        "tokens_per_s": T / med,
        "peak_gib": peak_gib(),
        "step_s": med,
        "memory": side.memory,
        "first_step_s": first,
        "first_step_compiles": compiles.report(),
    }
    if profile:
        handles = side.tag()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            t0 = time.perf_counter()
            side.step(docs)
            sync()
            wall = (time.perf_counter() - t0) * 1e3
        for h in handles:
            h.remove()
        res["split_ms"] = split_by_class(prof, wall)
        res["profiled_step_ms"] = wall
        if trace_file:
            with open(trace_file, "a") as f:
                f.write(f"\n## {name}\n")
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
                f.write("\nby the host's own time:\n")
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            chrome = f"{name.replace(' ', '-')}.json.gz"  # torch gzips it
            prof.export_chrome_trace(str(Path(trace_file).with_name(chrome)))
    if breakdown and DEV.type == "cuda":
        res["peak_breakdown_gib"] = peak_breakdown(functools.partial(side.step, docs))
    return res


def run_side(
    side_cls,
    folder: Path,
    tokens: list[int],
    layouts: list[str],
    experts: list[bool],
    steps: int,
    profile: bool,
    record,
    trace_file: str | None,
    breakdown: bool = False,
) -> None:
    """Each row on ``side_cls``: rows over LONG tokens with the side's memory saving on (Kiln's
    recompute, transformers' gradient checkpointing); a shorter row that runs out of memory
    without it runs again with it, as a user would turn it on."""
    first_done = False
    for with_experts in experts:
        side = side_cls(folder, with_experts)
        print(f"{side.name}: loaded (experts LoRA {with_experts}) in {side.load_s:.0f} s", flush=True)
        for T in tokens:
            for layout in layouts:
                docs = batch_of(T, layout, T)
                name = f"{side.name} {T} {layout} experts={with_experts}"
                for saving in [True] if T > LONG else [False, True]:
                    side.long_mode(saving)
                    try:
                        res = measure(side, docs, steps, profile, trace_file, breakdown, name)
                        res["compiles_in_first"] = not first_done
                        first_done = True
                        break
                    except torch.OutOfMemoryError as e:
                        res = {"tokens_per_s": None, "peak_gib": None, "error": f"out of memory: {str(e)[:160]}"}
                        res["memory"] = side.memory
                    finally:
                        side.opt.zero_grad(set_to_none=True)
                        free()
                record((T, layout, with_experts), side.name, res)
        del side
        free()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["kiln", "hf", "both"], default="both")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--layouts", nargs="+", default=["single", "packed4k"], choices=["single", "packed4k"])
    p.add_argument("--experts", choices=["no", "yes", "both"], default="both")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--ckpt", help="default .cache/e2e-kimi-linear-48b-5l (--check: .cache/e2e-check)")
    p.add_argument("--out", help="default bench/results/e2e.json (--check: .cache/e2e-check.json)")
    p.add_argument(
        "--trace-file",
        default=None,
        help="each profiled step's tables by GPU and by host time, appended as text, and its chrome trace"
        " (gzipped, beside it)",
    )
    p.add_argument(
        "--memory-breakdown", action="store_true", help="CUDA: what is alive at a step's peak, by allocation site"
    )
    p.add_argument(
        "--kiln-cache",
        nargs="+",
        default=KILN_CACHE,
        metavar="OP",
        help="the op classes Kiln's recompute keeps on the long rows (MemorySpec.cache_ops; default kernels)",
    )
    p.add_argument("--check", action="store_true", help="a tiny model on the CPU: the script runs, no more")
    a = p.parse_args()
    KILN_CACHE[:] = a.kiln_cache
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("engine.training.step").setLevel(logging.INFO)  # the rehearsal's time
    logging.getLogger("kiln_kernels.ahead").setLevel(logging.INFO)  # its pass apart from its compiles
    if a.check:
        global DEV, DOC, LONG
        DEV, DOC, LONG = torch.device("cpu"), 64, 128
        SHAPE.update(TINY)
    # a check's tiny checkpoint and numbers go elsewhere: never where a real run reads or records
    folder = Path(a.ckpt or (".cache/e2e-check" if a.check else ".cache/e2e-kimi-linear-48b-5l"))
    out = Path(a.out or (".cache/e2e-check.json" if a.check else "bench/results/e2e.json"))
    build_checkpoint(folder)
    done = carried(json.loads(out.read_text()) if out.exists() else {"rows": []}, device_name())
    rows = {(r["tokens"], r["layout"], r["experts"]): r for r in done["rows"]}

    def record(key, side, res):
        """The side's result into its row (a new row, or the side's keys replacing all it held)."""
        r = rows.setdefault(key, {"tokens": key[0], "layout": key[1], "experts": key[2], **EMPTY_ROW})
        for k in [k for k in r if k.startswith(f"{side}_")]:  # this run replaces all the side said before
            del r[k]
        r.update({k: None for k in EMPTY_ROW if k.startswith(f"{side}_")})
        for k, v in res.items():
            r[f"{side}_{k}"] = v
        r[f"{side}_date"] = datetime.date.today().isoformat()  # the sides may be measured on other days
        hf, kiln = r.get("hf_tokens_per_s"), r.get("kiln_tokens_per_s")
        r["speedup"] = kiln / hf if hf and kiln else None
        r["memory_ratio"] = (
            (r["kiln_peak_gib"] / r["hf_peak_gib"]) if r.get("hf_peak_gib") and r.get("kiln_peak_gib") else None
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    **done,  # the file's other keys: earlier runs kept by hand, another device's table
                    "rows": sorted(rows.values(), key=lambda r: (r["experts"], r["tokens"], r["layout"])),
                    "device": device_name(),
                    "torch": torch.__version__,
                    "date": datetime.date.today().isoformat(),
                },
                indent=1,
            )
            + "\n"
        )
        tps = res.get("tokens_per_s")
        print(
            f"{side:>4} {key[0]:>7} {key[1]:>8} experts={str(key[2]):<5} "
            + (
                f"{tps:>9.0f} tok/s  peak {res['peak_gib']:6.1f} GiB  first step {res['first_step_s']:.1f} s"
                f" ({res['first_step_compiles']['compiles']} compiles,"
                f" {res['first_step_compiles']['read_from_cache']} from the cache,"
                f" at launch {res['first_step_compiles']['compiled_at_launch']})"
                if tps
                else res.get("error", "")
            )
            + (f"  split {res['split_ms']}" if "split_ms" in res else ""),
            flush=True,
        )

    experts = {"no": [False], "yes": [True], "both": [False, True]}[a.experts]
    choices: dict[str, list[type]] = {"kiln": [Kiln], "hf": [HF], "both": [Kiln, HF]}
    sides = choices[a.side]
    for side in sides:
        run_side(
            side,
            folder,
            a.tokens,
            a.layouts,
            experts,
            a.steps,
            not a.no_profile,
            record,
            a.trace_file,
            a.memory_breakdown,
        )
    print(
        "\n| tokens | layout | experts | Kiln tok/s | HF tok/s | Kiln / HF | Kiln GiB | HF GiB | memory | "
        "Kiln first step s |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in sorted(rows.values(), key=lambda r: (r["experts"], r["tokens"], r["layout"])):
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"
        print(
            f"| {r['tokens']} | {r['layout']} | {r['experts']} | {f(r['kiln_tokens_per_s'], '.0f')} | "
            f"{f(r['hf_tokens_per_s'], '.0f')} | {f(r['speedup'], '.2f')}x | {f(r['kiln_peak_gib'], '.1f')} | "
            f"{f(r['hf_peak_gib'], '.1f')} | {f(r['memory_ratio'], '.2f')}x | {f(r.get('kiln_first_step_s'), '.1f')} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
