"""The training loop: LoRA, AdamW, warmup + cosine, clipping, checkpoints, exact resume.

Resume is exact: a checkpoint holds the adapter, the optimizer and scheduler state, the step and
the RNG state, and the batches of an epoch depend only on (seed, epoch), so a resumed run makes
the same steps the uninterrupted run would have made.
"""
from __future__ import annotations

import math
import resource
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.data import IGNORE, Dataset, ImageCache, collate, epoch_batches, split
from engine.lora import apply_lora, load_adapter, save_adapter
from engine.memory import apply_swap_core
from engine.spec import JobSpec, Reporter, Store, TrainResult
from engine.config import ModelConfig, count_parameters
from engine.model.moe import Router
from engine.models import ensure_builtin, load_base, save_base
from kiln.tokenizer import chat_template, load_tokenizer

BASE_LR = {"lora": 2e-3, "full": 1e-3}  # measured on kiln-tiny with the sample data; the multiplier scales it
DEFAULT_MAX_LEN = 4096  # for models without a position limit (Kimi Linear: KDA + NoPE attention)


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


def batch_loss(model: torch.nn.Module, batch: dict, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy over target tokens, the target count, and how many were argmax-right."""
    ids = batch["input_ids_BT"].to(device)
    labels = batch["labels_BT"].to(device)
    docs, pos = (batch[k].to(device) if batch[k] is not None else None for k in ("doc_ids_BT", "positions_BT"))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(ids, batch["pixels_NCHW"].to(device), docs, pos)
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    n = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum") / max(n, 1)
    right = int(((logits.argmax(-1) == labels) & (labels != IGNORE)).sum())
    return loss, n, right


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, indices: list[int], bs: int, pad: int, pack_to: int | None,
             device: torch.device) -> dict:
    was = model.training
    model.eval()
    total, n, right = 0.0, 0, 0
    for i in range(0, len(indices), bs):
        batch = collate([data[j] for j in indices[i:i + bs]], pad, pack_to)
        loss, k, r = batch_loss(model, batch, device)
        total, n, right = total + float(loss) * k, n + k, right + r
    model.train(was)
    return {"valid_loss": total / max(n, 1), "valid_mean_token_accuracy": right / max(n, 1)}


def _accumulate(model, samples, micro: int, pad: int, pack_to: int | None, device) -> tuple[torch.Tensor, int, int, int, int]:
    """Forward and backward the step's examples in ``micro`` parts, each weighted by its share
    of the step's target tokens: the gradient equals the whole batch's. Returns (loss, targets,
    right, tokens, rows) for the step."""
    total = sum(s.targets for s in samples) or 1
    size = math.ceil(len(samples) / micro)
    loss_sum, n_sum, right_sum, seen, rows = 0.0, 0, 0, 0, 0
    for i in range(0, len(samples), size):
        batch = collate(samples[i:i + size], pad, pack_to)
        loss, n, right = batch_loss(model, batch, device)
        extra = model.indexer_loss() if hasattr(model, "indexer_loss") and model.training else None
        ((loss + extra if extra is not None else loss) * (n / total)).backward()  # DSA indexers learn by KL
        loss_sum += float(loss.detach()) * n
        n_sum, right_sum = n_sum + n, right_sum + right
        seen += int((batch["input_ids_BT"] != pad).sum())
        rows += batch["input_ids_BT"].shape[0]
    return torch.tensor(loss_sum / max(n_sum, 1)), n_sum, right_sum, seen, rows


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _save_checkpoint(store: Store, key: str, model, spec: JobSpec, opt, sched, step: int, tokens: int) -> None:
    with store.publish_dir(key) as folder:
        if spec.training == "full":
            save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
                      str(folder / "model_state.safetensors"))
        else:
            save_adapter(model, spec.lora, spec.model, folder)
        torch.save({"step": step, "tokens": tokens, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "rng": torch.get_rng_state(),  # dropout on a GPU draws from the CUDA generators
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   folder / "trainer_state.pt")


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


def train(spec: JobSpec, store: Store, reporter: Reporter) -> TrainResult:
    with tempfile.TemporaryDirectory(prefix="kiln-job-") as work:
        return _train(spec, store, reporter, Path(work))


def _train(spec: JobSpec, store: Store, reporter: Reporter, work: Path) -> TrainResult:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = store.model_dir(spec.model)
    ensure_builtin(spec.model, model_dir)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"base model {spec.model!r} has no weights in {model_dir}")
    model = load_base(model_dir)
    cfg = model.config
    tok = load_tokenizer(model_dir)
    tpl = chat_template(tok)
    longest = getattr(cfg, "max_position_embeddings", DEFAULT_MAX_LEN)
    max_len = min(spec.max_seq_len or longest, longest)
    pack_to = max_len if spec.packing else None
    image_size, image_tokens = getattr(model, "image_size", 0), getattr(model, "image_tokens", None)  # None: text only

    reporter.message("Indexing the dataset")
    cache = ImageCache(image_size)
    train_set = Dataset(spec.training_file, spec.images_file, tok, tpl, image_size, image_tokens, max_len, work, cache)
    train_idx, valid_idx = split(len(train_set), spec.validation_split, spec.seed)
    valid_set = train_set
    if spec.validation_file:
        valid_set = Dataset(spec.validation_file, spec.images_file, tok, tpl, image_size, image_tokens,
                            max_len, work, cache)
        valid_idx = list(range(len(valid_set)))
    hp = resolve(spec, len(train_idx))

    torch.manual_seed(spec.seed)
    if spec.training == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        apply_lora(model, spec.lora)
    model.to(device).train()
    swap = apply_swap_core(model, spec.memory)
    if swap is not None:
        m = spec.memory
        reporter.message(f"Recompute: {m.recompute}" + (f", keeping {', '.join(m.cache_ops)} outputs on the {m.tier} tier"
                         + (f" as {m.quantize}" if m.quantize != "none" else "") if m.recompute == "selective" else ""), data=asdict(m))
    total_params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    tokens_per_epoch = sum(train_set.lengths[i] for i in train_idx)
    if isinstance(cfg, ModelConfig):  # the hybrid family counts from its config: active parameters too
        counts = count_parameters(cfg)
        reporter.message(f"{spec.model}: {counts['total']:,} parameters, {counts['active']:,} active per token",
                         data=counts)
    reporter.message(f"Model {spec.model}: {total_params:,} parameters, LoRA trains {n_train:,} "
                     f"({100 * n_train / total_params:.2f}%); {len(train_idx)} training examples "
                     f"({tokens_per_epoch:,} tokens), {len(valid_idx)} validation examples, {hp.total_steps} steps "
                     f"on {device.type}" + (f", packed into rows of {pack_to} tokens" if pack_to else ""),
                     data={"total_parameters": total_params, "trainable_parameters": n_train,
                           "tokens_per_epoch": tokens_per_epoch})
    reporter.resolved(hp.public())

    opt = torch.optim.AdamW(trainable, lr=hp.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(hp.warmup_steps, hp.total_steps))
    step, tokens = 0, 0
    if spec.resume_from:
        folder = store.path(spec.resume_from)
        if spec.training == "full":
            model.load_state_dict(load_file(str(folder / "model_state.safetensors")))
        else:
            load_adapter(model, folder)
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        step, tokens = state["step"], state["tokens"]
        reporter.message(f"Resumed from the checkpoint at step {step}", data={"step": step})

    pad, metrics, skipped = tpl.pad_id, {}, 0
    order: tuple[int, list[list[int]]] = (-1, [])
    while step < hp.total_steps:
        reason = reporter.should_stop()
        if reason:
            _close(train_set, valid_set)
            return TrainResult("stopped", trained_tokens=tokens, stop_reason=reason, final_metrics=metrics)
        t0 = time.perf_counter()
        epoch, index = divmod(step, hp.steps_per_epoch)
        if order[0] != epoch:
            order = (epoch, epoch_batches(train_set.lengths, train_idx, hp.batch_size, spec.seed, epoch,
                                          spec.group_by_length))
        samples = [train_set[i] for i in order[1][index]]
        loss, n, right, seen, rows = _accumulate(model, samples, spec.gradient_accumulation_steps, pad, pack_to, device)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        if torch.isfinite(grad_norm):
            opt.step()
        else:  # seen on the H200 in bf16: a finite loss, an overflowed backward; one bad step must not poison the weights
            skipped += 1
            reporter.message(f"Step {step + 1}: the gradient is not finite; the update was skipped "
                             f"({skipped} so far)", level="warn", data={"step": step + 1, "skipped_steps": skipped})
        if spec.training == "full":  # the base model itself learns: its routers rebalance too
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
            metrics.update(evaluate(model, valid_set, valid_idx, hp.batch_size, pad, pack_to, device))
        reporter.metrics(step, metrics)
        if is_ckpt:
            key = f"{spec.artifacts}/checkpoints/step-{step:07d}"
            _save_checkpoint(store, key, model, spec, opt, sched, step, tokens)
            reporter.checkpoint(step, key, {k: v for k, v in metrics.items() if "loss" in k or "accuracy" in k})

    _close(train_set, valid_set)
    if spec.training == "full":
        key = f"{spec.artifacts}/model"
        with store.publish_dir(key) as folder:
            save_base(model, folder)
        return TrainResult("succeeded", adapter_key=key, trained_tokens=tokens, final_metrics=metrics)
    adapter_key = f"{spec.artifacts}/adapter.zip"
    final = store.path(f"{spec.artifacts}/checkpoints/step-{step:07d}")
    with store.publish_file(adapter_key) as path:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                zf.write(final / name, name)
            zf.writestr("README.md", _model_card(spec, hp, {k: round(v, 4) for k, v in metrics.items() if "loss" in k}))
    return TrainResult("succeeded", adapter_key=adapter_key, trained_tokens=tokens, final_metrics=metrics)
