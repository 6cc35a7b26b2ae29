"""The training loop: LoRA, AdamW, warmup + cosine, clipping, checkpoints, exact resume.

Resume is exact: a checkpoint holds the adapter, the optimizer and scheduler state, the step and
the RNG state, and the batches of an epoch depend only on (seed, epoch), so a resumed run makes
the same steps the uninterrupted run would have made.
"""
from __future__ import annotations

import gc
import math
import resource
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.data import IGNORE, Dataset, ImageCache, collate, epoch_batches, split
from engine.lora import apply_lora, load_adapter, save_adapter, store_frozen
from engine.memory import apply_swap_core
from engine.spec import JobSpec, Reporter, Store, TrainResult
from engine.config import ModelConfig, count_parameters
from engine.model.moe import Router
from engine.models import ensure_builtin, load_base, position_limit, save_base
from kiln.dataset import LengthBound
from kiln.tokenizer import chat_template, load_tokenizer

BASE_LR = {"lora": 2e-3, "full": 1e-3}  # measured on kiln-tiny with the sample data; the multiplier scales it


@dataclass
class Resolved:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float
    total_steps: int
    steps_per_epoch: int
    checkpoint_interval: int
    warmup_steps: int

    def public(self) -> dict:
        return {"n_epochs": self.n_epochs, "batch_size": self.batch_size,
                "learning_rate_multiplier": self.learning_rate_multiplier, "learning_rate": self.learning_rate,
                "total_steps": self.total_steps, "checkpoint_interval": self.checkpoint_interval}


def resolve(spec: JobSpec, n_examples: int) -> Resolved:
    bs = spec.batch_size if spec.batch_size != "auto" else max(1, min(8, n_examples // 8))
    bs = min(bs, n_examples)
    epochs = spec.n_epochs if spec.n_epochs != "auto" else 3
    mult = spec.learning_rate_multiplier if spec.learning_rate_multiplier != "auto" else 1.0
    per_epoch = math.ceil(n_examples / bs)
    total = per_epoch * epochs
    if spec.max_steps:
        total = min(total, spec.max_steps)
    interval = spec.checkpoint_interval or per_epoch
    return Resolved(epochs, bs, float(mult), BASE_LR[spec.training] * mult, total, per_epoch, interval,
                    int(total * spec.warmup_ratio))


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine down to 10%
    return f


def batch_loss(model: torch.nn.Module, batch: dict, device: torch.device, cp=None) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy over target tokens, the target count, and how many were argmax-right.
    ``cp``: the batch is a context-parallel rank's slice (engine.parallel.context.split)."""
    ids = batch["input_ids_BT"].to(device)
    labels = batch["labels_BT"].to(device)
    docs, pos = (batch[k].to(device) if batch[k] is not None else None for k in ("doc_ids_BT", "positions_BT"))
    extra = {"cp": cp} if cp is not None else {}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss, right = model(ids, batch["pixels_NCHW"].to(device), docs, pos, labels_BT=labels, **extra)  # no full logits
    return loss, int((labels[:, 1:] != IGNORE).sum()), int(right)


def _batch(samples: list, pad: int, pack_to: int | None, mesh) -> tuple[dict, object, int]:
    """The collated batch (no shard), or under context parallel this rank's slice of it and its
    shard; and the rows it packed, counted on one rank of a context-parallel group."""
    batch = collate(samples, pad, pack_to)
    rows = batch["input_ids_BT"].shape[0]
    if mesh is None or mesh.cp == 1:
        return batch, None, rows
    from engine.parallel.context import split

    return *split(batch, pad, mesh.cp_group, mesh.cp_rank, mesh.cp), rows if mesh.cp_rank == 0 else 0


def _share(items: list, mesh, parts: int | None = None, size: int | None = None) -> list[list]:
    """This rank's share of ``items`` (data group g takes items g, g + groups, ...; the ranks of a
    context-parallel group share theirs) cut into ``parts`` contiguous lists, or lists of
    ``size``. Every rank gets as many lists (an empty one stands for nothing: collectives need
    every rank in every forward)."""
    world, rank = (mesh.data_world, mesh.data_rank) if mesh is not None else (1, 0)
    mine, per = items[rank::world], math.ceil(len(items) / world)
    size = size or max(1, math.ceil(per / parts))
    return [mine[i * size:(i + 1) * size] for i in range(math.ceil(per / size))]


def _sum(mesh, *values: float) -> list[float]:
    """Sum numbers over all ranks (the values themselves in a single process)."""
    if mesh is None:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, indices: list[int], bs: int, pad: int, pack_to: int | None,
             device: torch.device, mesh=None) -> dict:
    was = model.training
    model.eval()
    total, n, right = 0.0, 0, 0
    for part in _share(indices, mesh, size=bs):
        batch, cp, _ = _batch([data[j] for j in part or indices[:1]], pad, pack_to, mesh)  # a stand-in keeps the ranks in step
        loss, k, r = batch_loss(model, batch, device, cp)
        if part:
            total, n, right = total + float(loss) * k, n + k, right + r
    total, n, right = _sum(mesh, total, n, right)
    model.train(was)
    return {"valid_loss": total / max(n, 1), "valid_mean_token_accuracy": right / max(n, 1)}


def _accumulate(model, samples, micro: int, pad: int, pack_to: int | None, device, mesh=None
                ) -> tuple[torch.Tensor, int, int, int, int]:
    """Forward and backward this rank's share of the step's examples in ``micro`` parts, each
    weighted by its share of the target tokens of the whole step (on all ranks): the gradients,
    summed over the ranks, equal the whole batch's (context parallel too: each rank's slice holds
    its own targets). Returns (loss, targets, right, tokens, rows)
    for the step, over all ranks."""
    total = sum(s.targets for s in samples) or 1
    loss_sum, n_sum, right_sum, seen, rows = 0.0, 0, 0, 0, 0
    for part in _share(samples, mesh, parts=micro):
        batch, cp, packed = _batch(part or samples[:1], pad, pack_to, mesh)  # a stand-in, weighted 0, keeps the ranks in step
        loss, n, right = batch_loss(model, batch, device, cp)
        extra = model.indexer_loss() if hasattr(model, "indexer_loss") and model.training else None
        weight = n / total if part else 0.0
        ((loss + extra if extra is not None else loss) * weight).backward()  # DSA indexers learn by KL
        if part:
            loss_sum += float(loss.detach()) * n
            n_sum, right_sum = n_sum + n, right_sum + right
            seen += int((batch["input_ids_BT"] != pad).sum())  # under context parallel: this slice's
            rows += packed
    loss_sum, n_sum, right_sum, seen, rows = _sum(mesh, loss_sum, n_sum, right_sum, seen, rows)
    return torch.tensor(loss_sum / max(n_sum, 1)), int(n_sum), int(right_sum), int(seen), int(rows)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _save_checkpoint(store: Store, key: str, model, spec: JobSpec, opt, sched, step: int, tokens: int, mesh=None) -> None:
    if mesh is not None:
        return _save_sharded(store, key, model, spec, opt, sched, step, tokens, mesh)
    with store.publish_dir(key) as folder:
        if spec.training == "full":
            save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
                      str(folder / "model_state.safetensors"))
        else:
            save_adapter(model, spec.lora, spec.model, folder)
        torch.save(_trainer_state(step, tokens, sched, opt), folder / "trainer_state.pt")


def _trainer_state(step: int, tokens: int, sched, opt=None) -> dict:
    return {"step": step, "tokens": tokens, "scheduler": sched.state_dict(),
            **({"optimizer": opt.state_dict()} if opt is not None else {}),
            "rng": torch.get_rng_state(),  # dropout on a GPU draws from the CUDA generators
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _save_sharded(store: Store, key: str, model, spec: JobSpec, opt, sched, step: int, tokens: int, mesh) -> None:
    """A parallel run's checkpoint: every rank writes its shards of the trained weights and of
    AdamW's state into ``dcp/`` (loadable on any world size), rank 0 the adapter in PEFT's
    layout (gathered), the scheduler and its RNG state; each rank its own RNG state."""
    import torch.distributed as dist

    from engine.checkpoint import dcp
    from engine.parallel.fsdp import full_tensors

    full = spec.training == "full"
    names = None if full else {n for n, p in model.named_parameters() if p.requires_grad}
    with store.publish_dir(key) if mesh.rank == 0 else _nothing() as folder:
        box = [str(folder) if folder else None]
        dist.broadcast_object_list(box, src=0)
        folder = Path(box[0])
        dcp.save(folder / "dcp", model, mesh, opt, everything=full)
        gathered = full_tensors(model, mesh, names) if not full else None
        torch.save({"rng": torch.get_rng_state()}, folder / f"rng-{mesh.rank}.pt")
        if mesh.rank == 0:
            if not full:
                save_adapter(model, spec.lora, spec.model, folder, gathered)
            torch.save({**_trainer_state(step, tokens, sched), "lr": [g["lr"] for g in opt.param_groups]},
                       folder / "trainer_state.pt")
        dist.barrier()  # every shard is on disk before rank 0 publishes the folder


@contextmanager
def _nothing():
    yield None


def _resume(spec: JobSpec, store: Store, model, opt, sched, mesh) -> tuple[int, int]:
    """Load a checkpoint into the model, the optimizer and the scheduler: a sharded one (``dcp/``,
    written by a parallel run of any size) or a single process's. Returns (step, tokens)."""
    folder = store.path(spec.resume_from)
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    if (folder / "dcp").exists():
        from engine.checkpoint import dcp

        dcp.load(folder / "dcp", model, mesh, opt, everything=spec.training == "full")
        for g, lr in zip(opt.param_groups, state["lr"]):
            g["lr"] = lr
        rank = mesh.rank if mesh is not None else 0
        rng = folder / f"rng-{rank}.pt"
        torch.set_rng_state(torch.load(rng)["rng"] if rng.exists() else state["rng"])
    elif mesh is not None:
        raise ValueError(f"{spec.resume_from} was written by a single process; resume it with parallel.nproc 1")
    else:
        if spec.training == "full":
            model.load_state_dict(load_file(str(folder / "model_state.safetensors")))
        else:
            load_adapter(model, folder)
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
    sched.load_state_dict(state["scheduler"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available() and mesh is None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], state["tokens"]


def _gathered_model(model, model_dir: Path, mesh):
    """The trained model whole: itself in one process; in a parallel run a fresh copy on rank 0
    filled with the gathered weights (every rank takes part; the others get None)."""
    if mesh is None:
        return model
    from engine.parallel.fsdp import full_tensors

    weights = full_tensors(model, mesh)
    if mesh.rank != 0:
        return None
    whole = load_base(model_dir)
    keys = set(whole.state_dict())
    buffers = {n: b.detach().cpu() for n, b in model.named_buffers() if n in keys}
    whole.load_state_dict({**weights, **buffers}, strict=True)
    return whole


def _model_card(spec: JobSpec, hp: Resolved, metrics: dict) -> str:
    lines = [f"# LoRA adapter for {spec.model}", "", f"Trained by Kiln job `{spec.job_id}`.", "",
             "```python", "from peft import PeftModel", "model = PeftModel.from_pretrained(base_model, 'this-folder')", "```", "",
             "| setting | value |", "| --- | --- |"]
    for k, v in {**hp.public(), "lora_rank": spec.lora.rank, "lora_alpha": spec.lora.alpha,
                 "target_modules": ", ".join(spec.lora.target_modules), **metrics}.items():
        lines.append(f"| {k} | {v} |")
    return "\n".join(lines) + "\n"


def _close(*datasets: Dataset) -> None:
    for d in set(datasets):
        d.close()


def train(spec: JobSpec, store: Store, reporter: Reporter, mesh=None) -> TrainResult:
    """Train as ``spec`` says. With ``mesh`` (engine.parallel.mesh.Mesh, under torchrun) every rank
    calls this; only rank 0's reporter is heard, and rank 0's answer to ``should_stop`` holds for all.
    The objects alive when the loop starts (model, data, optimizer) are frozen out of Python's
    cyclic collector, whose full passes over them otherwise land inside some steps and stall
    them; a worker runs many jobs, so they are unfrozen when the job ends."""
    with tempfile.TemporaryDirectory(prefix="kiln-job-") as work:
        try:
            return _train(spec, store, reporter, Path(work), mesh)
        finally:
            gc.unfreeze()


def _stop_reason(reporter: Reporter, mesh) -> str | None:
    reason = reporter.should_stop()
    if mesh is None:
        return reason
    import torch.distributed as dist

    box = [reason]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train(spec: JobSpec, store: Store, reporter: Reporter, work: Path, mesh=None) -> TrainResult:
    device = mesh.device if mesh is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = store.model_dir(spec.model)
    ensure_builtin(spec.model, model_dir)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"base model {spec.model!r} has no weights in {model_dir}")
    model = load_base(model_dir)
    cfg = model.config
    if spec.parallel.cp_size > 1 and not getattr(model, "supports_context_parallel", False):
        raise ValueError(f"parallel.cp_size: {spec.model} has no context-parallel form yet; use 1")
    tok = load_tokenizer(model_dir)
    tpl = chat_template(tok)
    length = LengthBound(spec.model, position_limit(model), spec.max_seq_len)  # the API's rule (kiln.dataset)
    image_size, image_tokens = getattr(model, "image_size", 0), getattr(model, "image_tokens", None)  # None: text only

    reporter.message("Indexing the dataset")
    cache = ImageCache(image_size)
    train_set = Dataset(spec.training_file, spec.images_file, tok, tpl, image_size, image_tokens, length, work, cache)
    train_idx, valid_idx = split(len(train_set), spec.validation_split, spec.seed)
    valid_set = train_set
    if spec.validation_file:
        valid_set = Dataset(spec.validation_file, spec.images_file, tok, tpl, image_size, image_tokens,
                            length, work, cache)
        valid_idx = list(range(len(valid_set)))
    # rows of the job's bound; without one (no position limit, no max_seq_len) of the longest example
    max_len = length.bound or max(max(d.lengths) for d in {train_set, valid_set})
    pack_to = max_len if spec.packing else None
    hp = resolve(spec, len(train_idx))

    torch.manual_seed(spec.seed)
    if spec.training == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        apply_lora(model, spec.lora)
    model.train()
    swap = apply_swap_core(model, spec.memory)
    total_params = sum(p.numel() for p in model.parameters())  # counted whole, before any sharding
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if mesh is not None:
        from engine.parallel.fsdp import clip_grad_norm, parallelize, sync_router_load

        parallelize(model, mesh)
        reporter.message(f"Parallel: {mesh.world} processes, FSDP2 over all, experts split {mesh.ep} ways"
                         + (f", each sequence split {mesh.cp} ways (context parallel)" if mesh.cp > 1 else ""),
                         data={"world_size": mesh.world, "ep_size": mesh.ep, "cp_size": mesh.cp})
    else:
        if device.type == "cuda" and spec.training != "full":  # the steps run under bf16 autocast
            store_frozen(model, torch.bfloat16)  # (FSDP2 shards one dtype per group: not with a mesh)
        model.to(device)
    if swap is not None:
        m = spec.memory
        reporter.message(f"Recompute: {m.recompute}" + (f", keeping {', '.join(m.cache_ops)} outputs on the {m.tier} tier"
                         + (f" as {m.quantize}" if m.quantize != "none" else "") if m.recompute == "selective" else ""), data=asdict(m))
    trainable = [p for p in model.parameters() if p.requires_grad]
    tokens_per_epoch = sum(train_set.lengths[i] for i in train_idx)
    if isinstance(cfg, ModelConfig):  # the hybrid family counts from its config: active parameters too
        counts = count_parameters(cfg)
        reporter.message(f"{spec.model}: {counts['total']:,} parameters, {counts['active']:,} active per token",
                         data=counts)
    reporter.message(f"Model {spec.model}: {total_params:,} parameters, LoRA trains {n_train:,} "
                     f"({100 * n_train / total_params:.2f}%); {len(train_idx)} training examples "
                     f"({tokens_per_epoch:,} tokens), {len(valid_idx)} validation examples, {hp.total_steps} steps "
                     f"on {device.type}" + (f" x {mesh.world}" if mesh is not None else "") + (f", packed into rows of {pack_to} tokens" if pack_to else ""),
                     data={"total_parameters": total_params, "trainable_parameters": n_train,
                           "tokens_per_epoch": tokens_per_epoch})
    reporter.resolved(hp.public())

    opt = torch.optim.AdamW(trainable, lr=hp.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(hp.warmup_steps, hp.total_steps))
    step, tokens = 0, 0
    if spec.resume_from:
        step, tokens = _resume(spec, store, model, opt, sched, mesh)
        reporter.message(f"Resumed from the checkpoint at step {step}", data={"step": step})

    pad, metrics, skipped = tpl.pad_id, {}, 0
    order: tuple[int, list[list[int]]] = (-1, [])
    gc.collect()
    gc.freeze()  # see train
    while step < hp.total_steps:
        reason = _stop_reason(reporter, mesh)
        if reason:
            _close(train_set, valid_set)
            return TrainResult("stopped", trained_tokens=tokens, stop_reason=reason, final_metrics=metrics)
        t0 = time.perf_counter()
        epoch, index = divmod(step, hp.steps_per_epoch)
        if order[0] != epoch:
            order = (epoch, epoch_batches(train_set.lengths, train_idx, hp.batch_size, spec.seed, epoch,
                                          spec.group_by_length))
        samples = [train_set[i] for i in order[1][index]]
        loss, n, right, seen, rows = _accumulate(model, samples, spec.gradient_accumulation_steps, pad, pack_to, device,
                                                 mesh)
        grad_norm = clip_grad_norm(trainable, 1.0) if mesh is not None else torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        if torch.isfinite(grad_norm):
            opt.step()
        else:  # seen on the H200 in bf16: a finite loss, an overflowed backward; one bad step must not poison the weights
            skipped += 1
            reporter.message(f"Step {step + 1}: the gradient is not finite; the update was skipped "
                             f"({skipped} so far)", level="warn", data={"step": step + 1, "skipped_steps": skipped})
        if spec.training == "full":  # the base model itself learns: its routers rebalance too
            if mesh is not None:
                sync_router_load(model)
            for m in model.modules():
                if isinstance(m, Router):
                    m.update_bias(spec.moe_bias_rate)
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += seen
        metrics = {"step": step, "total_steps": hp.total_steps, "epoch": epoch + 1, "train_loss": float(loss),
                   "train_mean_token_accuracy": right / max(n, 1), "learning_rate": sched.get_last_lr()[0],
                   "grad_norm": float(grad_norm), "tokens_per_second": seen / (time.perf_counter() - t0),
                   "trained_tokens": tokens, "rows": rows, "skipped_steps": skipped,
                   "peak_memory_mb": peak_memory_mb(device)}
        if swap is not None and swap.ops:  # what Swap Core kept at its fullest this step
            metrics.update({f"swap_{tier}_mb": swap.peak[tier] / 2**20 for tier in ("device", "host")})
            swap.reset_peaks()
        is_ckpt = step % hp.checkpoint_interval == 0 or step == hp.total_steps
        if is_ckpt and valid_idx:
            metrics.update(evaluate(model, valid_set, valid_idx, hp.batch_size, pad, pack_to, device, mesh))
        reporter.metrics(step, metrics)
        if is_ckpt:
            key = f"{spec.artifacts}/checkpoints/step-{step:07d}"
            _save_checkpoint(store, key, model, spec, opt, sched, step, tokens, mesh)
            reporter.checkpoint(step, key, {k: v for k, v in metrics.items() if "loss" in k or "accuracy" in k})

    _close(train_set, valid_set)
    if spec.training == "full":
        key = f"{spec.artifacts}/model"
        whole = _gathered_model(model, model_dir, mesh)
        if whole is not None:
            with store.publish_dir(key) as folder:
                save_base(whole, folder)
        return TrainResult("succeeded", adapter_key=key, trained_tokens=tokens, final_metrics=metrics)
    adapter_key = f"{spec.artifacts}/adapter.zip"
    if mesh is not None and mesh.rank != 0:
        return TrainResult("succeeded", adapter_key=adapter_key, trained_tokens=tokens, final_metrics=metrics)
    final = store.path(f"{spec.artifacts}/checkpoints/step-{step:07d}")
    with store.publish_file(adapter_key) as path:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                zf.write(final / name, name)
            zf.writestr("README.md", _model_card(spec, hp, {k: round(v, 4) for k, v in metrics.items() if "loss" in k}))
    return TrainResult("succeeded", adapter_key=adapter_key, trained_tokens=tokens, final_metrics=metrics)
