"""Decoding speed: Kiln's incremental decoder (engine.inference: the KDA state, the short
convolutions' tails and MLA's compressed latent rows kept; an adapter served unmerged) against
transformers' ``generate()`` with the same adapter through PEFT, on a Kimi Linear checkpoint.

    python3 -m bench.decode                 # the H200: Kimi-Linear-48B's layer shapes (bench.e2e.SHAPE)
    python3 -m bench.decode --device cpu    # the CPU: a tiny Kimi Linear (bench.e2e.TINY)

The checkpoint is transformers' ``KimiLinearForCausalLM`` with random weights (5 layers: KDA x3,
MLA, KDA), saved by transformers and loaded by both sides from that folder. The adapter: LoRA rank
16 on q/k/v/o, the MLPs' and every expert's projections, every factor random (B too), saved by
Kiln in PEFT's layout; PEFT loads it onto transformers' model, Kiln serves it beside the base.

Each row: ``batch`` prompts of ``prompt`` random tokens, ``new`` tokens each, greedy, no early end;
each side timed ``REPEAT`` times after a warm-up, the median reported.
``prefill_s``: to the first token; decode tokens/s: ``batch * (new - 1)`` over the time after it
(transformers: timed by a streamer, called as each token comes; the H200 rows of 2026-12-04 timed
the whole call less a prefill timed apart, a method the CPU's long prefills made useless).
Memory per sequence: the decode state a sequence holds after its prompt and answer (Kiln: the
cache's tensors, counted; transformers: the tensors of ``past_key_values``, counted), and its
KDA layers' part, which does not grow with the length. Both sides in bf16 on CUDA or an NPU (Kiln:
bf16 weights under bf16 autocast, as its trainer), fp32 on the CPU.

Appends its run to bench/results/decode.json (``{"runs": [...]}``, every run kept: either side
moves between runs, and the spread is part of the result): ``{"device", "date", "command",
"rows": [{"batch", "prompt", "new", "kiln_tokens_per_s", "hf_tokens_per_s", "ratio",
"kiln_prefill_s", "hf_prefill_s", "kiln_state_mib_per_seq", "hf_state_mib_per_seq",
"kiln_kda_state_mib_per_seq"}]}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from bench.cuda_time import default_device
from bench.e2e import EXPERTS, SHAPE, TARGETS, TINY
from engine import device as accelerator

RESULTS = Path(__file__).resolve().parent / "results" / "decode.json"
REPEAT = 3  # timed runs a side and size, the median reported: either side moved by up to 80% between runs


def build(folder: Path, shape: dict, device: torch.device) -> None:
    import transformers

    torch.manual_seed(0)
    dtype = torch.bfloat16 if accelerator.accelerated(device) else torch.float32
    torch.set_default_dtype(dtype)
    with device:
        model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**shape))
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # weights that matter (transformers' init leaves some at zero)
        for name, p in model.named_parameters():
            if "norm" not in name and "A_log" not in name and "dt_bias" not in name:
                p.normal_(0, 0.02)
    model.save_pretrained(folder)


def make_adapter(ckpt: Path, folder: Path) -> None:
    from engine.lora import apply_lora, save_adapter
    from engine.model.registry import load_base
    from kiln.spec import LoraSpec

    model = load_base(ckpt)
    spec = LoraSpec(rank=16, alpha=32.0, target_modules=TARGETS, target_parameters=EXPERTS)
    apply_lora(model, spec)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    save_adapter(model, spec, "bench", folder)


def tensor_bytes(obj: Any, seen: set | None = None) -> int:
    """The bytes of every tensor reachable from obj (lists, tuples, dicts, attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def sync(device: torch.device) -> None:
    accelerator.synchronize(device)


def kiln_server(ckpt: Path, adapter: Path, device: torch.device):
    from engine.inference import Batcher

    b = Batcher(ckpt, device=device)  # the server's model, the adapter beside it
    b.add_adapter("bench", adapter)
    return b


def kiln(b, device: torch.device, batch: int, prompt: int, new: int) -> dict:
    from engine.inference import Decoder, Prompt, Sampling

    dec = Decoder(b.model, b.tok, b.tpl, batch)  # driven here, without the server's thread
    dec.ends = set()
    g = torch.Generator().manual_seed(prompt)
    vocab = b.model.config.vocab_size
    prompts = [
        Prompt(torch.randint(3, vocab, (prompt,), generator=g).tolist(), None, "bench", Sampling(new, temperature=0))
        for _ in range(batch)
    ]
    dec.prefill(prompts[:1])  # warm-up: compiles, autotuning
    while dec.running:
        dec.step()
    runs = []
    for _ in range(REPEAT):
        sync(device)
        t0 = time.perf_counter()
        dec.prefill(prompts)
        sync(device)
        t1 = time.perf_counter()
        while len(dec.running) == batch and all(len(c.ids) < new - 1 for c in dec.running):
            dec.step()
        kept = {k: t for k, t in dec.cache.kept.items()}
        lengths = [dec.cache.length[c.slot] for c in dec.running]
        while dec.running:
            dec.step()
        sync(device)
        runs.append((batch * (new - 1) / (time.perf_counter() - t1), t1 - t0))
    per_seq = kda = 0
    for (_, what), t in kept.items():
        row = t[0].numel() * t.element_size()
        if what == "kv":  # key rows: only the ones a sequence fills (prompt + answer)
            row = row // t.shape[1] * (max(lengths) + 1)
        else:
            kda += row
        per_seq += row
    return {
        "kiln_tokens_per_s": median(r[0] for r in runs),
        "kiln_prefill_s": median(r[1] for r in runs),
        "kiln_state_mib_per_seq": per_seq / 2**20,
        "kiln_kda_state_mib_per_seq": kda / 2**20,
    }


def profile(b, device: torch.device, batch: int, prompt: int, steps: int = 5) -> None:
    """Kiln's decode steps under the torch profiler: the ops by host time and by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run

    from engine.inference import Decoder, Prompt, Sampling

    dec = Decoder(b.model, b.tok, b.tpl, batch)
    dec.ends = set()
    g = torch.Generator().manual_seed(prompt)
    vocab = b.model.config.vocab_size
    dec.prefill(
        [
            Prompt(torch.randint(3, vocab, (prompt,), generator=g).tolist(), None, "bench", Sampling(64, temperature=0))
            for _ in range(batch)
        ]
    )
    for _ in range(3):
        dec.step()
    sync(device)
    with run(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step()
        sync(device)
        wall = (time.perf_counter() - t0) / steps
    print(f"profile: batch {batch} prompt {prompt}: {wall * 1e3:.1f} ms a step", flush=True)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    print(table.table(sort_by="self_device_time_total", row_limit=15), flush=True)
    shapes = prof.key_averages(group_by_input_shape=True)
    print(shapes.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=30), flush=True)


def hf_model(ckpt: Path, adapter: Path, device: torch.device):
    import peft
    import transformers

    dtype = torch.bfloat16 if accelerator.accelerated(device) else torch.float32
    base = transformers.KimiLinearForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device)  # type: ignore[arg-type]
    return peft.PeftModel.from_pretrained(base, adapter).eval()


def hf(model, device: torch.device, batch: int, prompt: int, new: int) -> dict:
    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(
        3, SHAPE["vocab_size"] if accelerator.accelerated(device) else TINY["vocab_size"], (batch, prompt), generator=g
    )
    ids = ids.to(device)

    class Clock:
        """generate()'s streamer: the time each new token came (the prompt comes first)."""

        def __init__(self):
            self.times: list[float] = []

        def put(self, value) -> None:
            sync(device)
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(n: int) -> Clock:
        clock = Clock()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        return clock

    run(2)  # warm-up
    with torch.no_grad():  # the state a sequence holds after its answer
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            min_new_tokens=2,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    state = tensor_bytes(out.past_key_values) / batch
    runs = [run(new).times for _ in range(REPEAT)]  # the prompt's put, then one a new token: prefill to the first
    return {
        "hf_tokens_per_s": median(batch * (new - 1) / (t[-1] - t[1]) for t in runs),
        "hf_prefill_s": median(t[1] - t[0] for t in runs),
        "hf_state_mib_per_seq": state / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default=str(default_device()))  # CUDA, else an Ascend NPU
    p.add_argument(
        "--new", type=int, default=None, help="tokens per answer (default 64 on an accelerator, 16 on the CPU)"
    )
    p.add_argument("--ckpt", type=Path, default=None)
    p.add_argument("--sizes", default="1x512,8x512,1x4096,8x4096", help="batch x prompt, comma-separated")
    p.add_argument("--profile", action="store_true", help="profile Kiln's decode steps (batch 8, prompt 512) and stop")
    a = p.parse_args()
    device = torch.device(a.device)
    new = a.new or (64 if accelerator.accelerated(device) else 16)
    shape = SHAPE if accelerator.accelerated(device) else TINY
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.ckpt or Path(tmp) / "ckpt"
        if not (ckpt / "config.json").exists():
            build(ckpt, shape, device)
        adapter = Path(tmp) / "adapter"
        make_adapter(ckpt, adapter)
        sizes = [tuple(int(x) for x in size.split("x")) for size in a.sizes.split(",")]
        rows: list[dict[str, Any]] = [{"batch": b, "prompt": n, "new": new} for b, n in sizes]
        server = kiln_server(ckpt, adapter, device)
        if a.profile:
            profile(server, device, 8, 512)
            return
        for row in rows:
            row.update(kiln(server, device, row["batch"], row["prompt"], new))
        server.close()
        del server
        accelerator.empty_cache(device)
        model = hf_model(ckpt, adapter, device)
        for row in rows:
            row.update(hf(model, device, row["batch"], row["prompt"], new))
            row["ratio"] = row["kiln_tokens_per_s"] / row["hf_tokens_per_s"]
            print(
                f"batch {row['batch']} prompt {row['prompt']}: Kiln {row['kiln_tokens_per_s']:.1f} tok/s,"
                f" transformers + PEFT {row['hf_tokens_per_s']:.1f} tok/s ({row['ratio']:.2f}x); prefill"
                f" {row['kiln_prefill_s']:.2f} s vs {row['hf_prefill_s']:.2f} s; state per sequence"
                f" {row['kiln_state_mib_per_seq']:.2f} MiB (KDA {row['kiln_kda_state_mib_per_seq']:.2f}) vs"
                f" {row['hf_state_mib_per_seq']:.2f} MiB",
                flush=True,
            )
    command = shlex.join(["python3", "-m", "bench.decode", *sys.argv[1:]])
    out = {
        "device": accelerator.name(device),
        "date": datetime.date.today().isoformat(),
        "command": command,
        "rows": rows,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    prev = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({"runs": [*prev.get("runs", []), out]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
