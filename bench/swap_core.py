"""Swap Core on the hybrid model: step time and peak memory of a LoRA training step for no
recompute, full recompute, and Swap Core on each tier and quantization, all in one run.

    python3 -m bench.swap_core --variant NAME       # the H200 size (below), bf16 autocast
    python3 -m bench.swap_core --size debug --device cpu --out /tmp/swap_core.json
                                                    # seconds, to check the script (not into the results)

Each mode trains the same model on the same batch (LoRA on every projection and on the experts;
the loss as engine.trainer computes it, fused with the head in vocab chunks; an optimizer step at
lr 0, so every mode starts from the same weights): ``--warmup`` steps, then the median of
``--steps`` timed steps; peak memory is the device's ``max_memory_allocated`` over the timed steps.
The first step's gradients are compared with the no-recompute run's (bit-equal expected without
quantization). Baseline: full recompute, measured in the same run (the issue's goal: >= 1.15x its
speed at <= 1.1x its peak memory).
Writes its results as variant ``--variant`` (default "default") of bench/results/swap_core.json,
keeping the file's other variants (bench/variants.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from bench.variants import write_variant
from engine import device as accelerator
from engine.config import DSAConfig, KDAConfig, ModelConfig, MoEConfig
from engine.lora import apply_lora, store_frozen
from engine.memory import apply_swap_core
from engine.model.hybrid import HybridForCausalLM
from kiln.spec import LoraSpec, MemorySpec

ALL = ["mm", "grouped_mm", "kernels"]  # "swap core": the matmuls (a dispatch mode) and the kernels
MODES = {
    "no recompute": MemorySpec(),
    "no recompute, again": MemorySpec(),  # the run-to-run noise of the gradients
    "full recompute": MemorySpec(recompute="full"),
    "swap core, device": MemorySpec(recompute="selective", cache_ops=ALL, tier="device"),
    "swap core, host": MemorySpec(recompute="selective", cache_ops=ALL, tier="host"),
    "swap core, host, int8": MemorySpec(recompute="selective", cache_ops=ALL, tier="host", quantize="int8"),
    "swap core, host, fp8": MemorySpec(recompute="selective", cache_ops=ALL, tier="host", quantize="fp8"),
    "swap core, device, fp8": MemorySpec(recompute="selective", cache_ops=ALL, tier="device", quantize="fp8"),
    # the MLPs alone recomputed: the attention blocks (KDA, DSA) keep their activations
    "full recompute, MLPs": MemorySpec(recompute="full", blocks=["mlp"]),
    "swap core, device, MLPs": MemorySpec(recompute="selective", cache_ops=ALL, tier="device", blocks=["mlp"]),
    "swap core, host, MLPs": MemorySpec(recompute="selective", cache_ops=ALL, tier="host", blocks=["mlp"]),
    # only the kernels' forwards kept (no dispatch mode): little memory for their recompute time
    "swap core, device, kernels": MemorySpec(recompute="selective", cache_ops=["kernels"]),
    "swap core, host, kernels": MemorySpec(recompute="selective", tier="host", cache_ops=["kernels"]),
    # and the LoRA projections' outputs, kept at the call too: ~5 µs of recompute per MB, for the host
    "swap core, device, kernels+proj": MemorySpec(recompute="selective", cache_ops=["kernels", "projections"]),
    "swap core, host, kernels+proj": MemorySpec(
        recompute="selective", tier="host", cache_ops=["kernels", "projections"]
    ),
    # the device for the last 700 (1500, 2500, 3000) MB of the forward's kept outputs, the host before them
    "swap core, auto, kernels+proj": MemorySpec(
        recompute="selective", tier="auto", device_budget_mb=700, cache_ops=["kernels", "projections"]
    ),
    "swap core, auto 2500, kernels+proj": MemorySpec(
        recompute="selective", tier="auto", device_budget_mb=2500, cache_ops=["kernels", "projections"]
    ),
    "swap core, auto 3000, kernels+proj": MemorySpec(
        recompute="selective", tier="auto", device_budget_mb=3000, cache_ops=["kernels", "projections"]
    ),
    "swap core, auto 1500, kernels+proj": MemorySpec(
        recompute="selective", tier="auto", device_budget_mb=1500, cache_ops=["kernels", "projections"]
    ),
    # and the experts' grouped GEMMs (output, gate/up product, LoRA's rank-r products)
    "swap core, host, kernels+proj+experts": MemorySpec(
        recompute="selective", tier="host", cache_ops=["kernels", "projections", "experts"]
    ),
    "swap core, auto 1500, kernels+proj+experts": MemorySpec(
        recompute="selective", tier="auto", device_budget_mb=1500, cache_ops=["kernels", "projections", "experts"]
    ),
}
BASELINE = "full recompute"


def bench_config(size: str) -> tuple[ModelConfig, int]:
    """(model, tokens). ``h200``: K3's layer shapes at a quarter of the width where it matters
    little (KDA 32 x 128 heads, hidden 4096), a K3-like MoE slice (64 experts, top-8, latent),
    3 KDA + 1 Gated DSA layers, one packed row of 4096 tokens."""
    if size == "debug":
        c = ModelConfig.debug(vocab_size=512)
        c.layers, c.attn_res_block, c.vision = 4, 4, None
        return c, 128
    c = ModelConfig(
        vocab_size=32000,
        hidden=4096,
        layers=4,
        kda=KDAConfig(heads=32, head_dim=128, gate_lower_bound=-5.0, full_rank_gate=True),
        dsa=DSAConfig(
            heads=32,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope=128,
            qk_rope=64,
            v_dim=128,
            index_heads=16,
            index_head_dim=128,
            index_topk=2048,
            gated=True,
            rope=False,
        ),
        moe=MoEConfig(experts=64, top_k=8, inter=1024, shared=1, latent=2048, first_dense=1, dense_inter=8192),
        activation="situ",
        attn_res=True,
        attn_res_block=4,
    )
    return c, 4096


def build(c: ModelConfig, device: torch.device, base: str = "bf16") -> HybridForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = HybridForCausalLM(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "A_log" in name or "dt_bias" in name or "attn_res" in name:
                p.zero_()
            else:
                p.normal_(0, 0.02)
    apply_lora(
        model,
        LoraSpec(
            rank=16,
            alpha=32,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "g_proj",
                "o_proj",
                "q_a_proj",
                "q_b_proj",
                "kv_b_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "latent_down",
                "latent_up",
            ],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    if accelerator.accelerated(device) and base == "bf16":
        store_frozen(model, torch.bfloat16)  # as the trainer does on one GPU
    return model.train()


def unwrap(model: HybridForCausalLM) -> None:
    """Undo apply_swap_core: the blocks' forwards back to their classes'."""
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            vars(block).pop("forward", None)


def loss_of(model, ids, device) -> torch.Tensor:
    """The next-token loss as engine.trainer computes it: the fused linear + cross-entropy in vocab
    chunks (kiln_kernels.loss), never the full logits."""
    with accelerator.autocast(device):
        loss, _ = model(ids, labels_BT=ids)
    return loss


def step(model, opt, ids, device) -> None:
    loss_of(model, ids, device).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def rel_err(got: dict, ref: dict) -> float:
    """Relative Frobenius error of a set of gradients against another, in fp64."""
    num = sum(((got[n].double() - ref[n].double()) ** 2).sum() for n in ref)
    return float((num / sum((ref[n].double() ** 2).sum() for n in ref)).sqrt())


def ready(model, spec: MemorySpec):
    """The model under ``spec`` alone: (its SwapCore, the trainable parameters, an optimizer with
    lr 0: the weights stay, the optimizer step still runs)."""
    unwrap(model)
    core = apply_swap_core(model, spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return core, trainable, torch.optim.SGD(trainable, lr=0.0)


def run_mode(model, spec: MemorySpec, ids, device, warmup: int, steps: int, ref: dict | None) -> tuple[dict, dict]:
    core, trainable, opt = ready(model, spec)
    saved = [p.detach().clone() for p in trainable]  # every mode starts from the same weights
    loss_of(model, ids, device).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.zero_grad(set_to_none=True)
    for _ in range(warmup):
        step(model, opt, ids, device)
    accelerator.synchronize(device)
    accelerator.reset_peak(device)
    times: list[float] = []
    collecting: list[float] = []

    def collector(phase, _):  # Python's own pauses inside the timed steps
        collecting.append(time.perf_counter() if phase == "start" else time.perf_counter() - collecting.pop())

    gc.callbacks.append(collector)
    try:
        for _ in range(steps):
            accelerator.synchronize(device)
            t0 = time.perf_counter()
            step(model, opt, ids, device)
            accelerator.synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(collector)
    peak = accelerator.max_allocated(device) / 2**30 if accelerator.accelerated(device) else float("nan")
    with torch.no_grad():
        for p, s in zip(trainable, saved, strict=True):
            p.copy_(s)
    out = {
        "step_s": statistics.median(times),
        "times_s": times,
        "gc_s": sum(collecting),
        "peak_gib": peak,
        "kept_device_gib": core.peak["device"] / 2**30 if core else 0.0,
        "kept_host_gib": core.peak["host"] / 2**30 if core else 0.0,
    }
    if ref is not None:
        out["grad_rel_err"] = rel_err(grads, ref)
        out["grads_bit_equal"] = all(torch.equal(grads[n], ref[n]) for n in ref)
    return out, grads


def _profiled(model, name: str, ids, device):
    """(wall seconds, torch.profiler's ops) of one step of a mode, after a warm one."""
    _, _, opt = ready(model, MODES[name])
    step(model, opt, ids, device)  # warm
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    )
    accelerator.synchronize(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        step(model, opt, ids, device)
        accelerator.synchronize(device)
    return time.perf_counter() - t0, prof.key_averages(), opt


def profile(model, name: str, ids, device) -> None:
    """One step of a mode under torch.profiler: wall time against the time the device was busy
    (a step much longer than its kernels is bound by the host), the ops that took it, what the
    mode adds to a step without recompute op by op (its recompute, copies and waits), and where
    the host waited for the device."""
    wall, events, opt = _profiled(model, name, ids, device)
    cuda = device.type == "cuda"
    busy = sum(e.self_device_time_total for e in events) / 1e3
    print(
        f"\n{name}: step {1e3 * wall:.0f} ms under the profiler, device busy {busy:.0f} ms, "
        f"{sum(e.count for e in events)} ops"
    )
    print(
        events.table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=30, max_name_column_width=48
        )
    )
    if name != "no recompute":
        own = lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total
        base = {e.key: (own(e), e.count) for e in _profiled(model, "no recompute", ids, device)[1]}
        more = sorted(
            ((own(e) - base.get(e.key, (0, 0))[0], e.count - base.get(e.key, (0, 0))[1], e.key) for e in events),
            reverse=True,
        )
        print(
            f"more than no recompute ({'device' if cuda else 'host'} ms, calls; the profiler lists an aten op "
            "and its kernels both):"
        )
        for us, n, key in more[:25]:
            print(f"{us / 1e3:9.2f} {n:6d}  {key[:100]}")
        _, _, opt = ready(model, MODES[name])
    if cuda:  # where the host waited for the device, by the line that asked
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.module(device).set_sync_debug_mode("warn")
            try:
                step(model, opt, ids, device)
            finally:
                accelerator.module(device).set_sync_debug_mode("default")
        where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        print(
            f"host syncs in a step: {sum(where.values())} ({', '.join(f'{k} x{v}' for k, v in where.most_common(12))})"
        )
    waits = sorted(
        (e for e in events if (e.key.startswith("cuda") and "Sync" in e.key) or "Memcpy" in e.key),
        key=lambda e: -e.self_cpu_time_total,
    )
    print("host waits: " + ", ".join(f"{e.key} x{e.count} {e.self_cpu_time_total / 1e3:.1f} ms" for e in waits))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["h200", "debug"], default="h200")
    p.add_argument("--device", default=accelerator.best())
    p.add_argument("--tokens", type=int, help="tokens in the packed row (default: the size's)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms: CUDA's atomics (index_add_ in the MoE loop) "
        "otherwise make even two identical runs differ",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        default=[],
        choices=list(MODES),
        help="after the timings, one profiled step of each of these modes",
    )
    p.add_argument(
        "--base",
        choices=["bf16", "fp32"],
        default="bf16",
        help="the frozen base weights on a GPU: bf16 as the trainer stores them, or fp32 (cast by "
        "autocast at every use)",
    )
    p.add_argument(
        "--variant",
        default="default",
        help="the name this run's results are kept under in the results file (its other variants stay)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "swap_core.json",
        help="the results file: the bench's own by default, another path for a trial run",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    cfg, tokens = bench_config(args.size)
    tokens = args.tokens or tokens
    weights = args.base if accelerator.accelerated(device) else "fp32"
    model = build(cfg, device, weights)
    gc.collect()
    gc.freeze()  # as engine.trainer does before its loop: no full collection stalls a step
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    results, ref = {}, None
    for name in dict.fromkeys(["no recompute", BASELINE, *args.modes]):  # the reference and the baseline first
        try:
            results[name], grads = run_mode(model, MODES[name], ids, device, args.warmup, args.steps, ref)
        except torch.OutOfMemoryError:
            results[name] = {"oom": True}
            grads = None
        if name == "no recompute":
            ref = grads
        accelerator.empty_cache(device)
        print(name, results[name].get("step_s", "OOM"), flush=True)
    base = results[BASELINE]
    print(
        f"\nSwap Core, hybrid {args.size} ({tokens} tokens, LoRA, {weights} base, bf16 autocast on {device}"
        f"{', deterministic' if args.deterministic else ''}); baseline: {BASELINE}"
    )
    print(
        f"{'mode':<24} {'step ms':>9} {'speed vs full':>14} {'peak GiB':>9} {'mem vs full':>12} "
        f"{'kept dev/host GiB':>18} {'grad err':>9}"
    )
    for name, r in results.items():
        if r.get("oom"):
            print(f"{name:<24} {'OOM':>9}")
            continue
        err = "-" if "grad_rel_err" not in r else "exact" if r["grads_bit_equal"] else f"{r['grad_rel_err']:.1e}"
        print(
            f"{name:<24} {1e3 * r['step_s']:>9.1f} {base['step_s'] / r['step_s']:>13.3f}x {r['peak_gib']:>9.2f} "
            f"{r['peak_gib'] / base['peak_gib']:>11.3f}x {r['kept_device_gib']:>8.2f}/"
            f"{r['kept_host_gib']:<9.2f} {err:>9}"
        )
    report = {
        "size": args.size,
        "tokens": tokens,
        "device": accelerator.name(device),
        "torch": torch.__version__,
        "config": json.loads(cfg.to_json()),
        "deterministic": args.deterministic,
        "base": weights,
        "baseline": BASELINE,
        "results": results,
    }
    write_variant(args.out, args.variant, report, "bench.swap_core", sys.argv[1:] if argv is None else argv)
    for name in args.profile:
        profile(model, name, ids, device)
    return report


if __name__ == "__main__":
    main()
