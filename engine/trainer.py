"""The training loop: ``Trainer`` sets up, steps, evaluates and runs, around its components
(engine/training): an objective (LoRA or full), a checkpointer (exact resume) and ranks (one
process or a mesh). ``train`` is the entry: every rank of a parallel run calls it (torchrun's
go-between, engine/launch.py, sits above).

The objects alive when the loop starts (model, data, optimizer) are frozen out of Python's
cyclic collector, whose full passes over them otherwise land inside some steps and stall them; a
worker runs many jobs, so they are unfrozen when the job ends.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import torch

from engine import device as accelerator
from engine.config import ModelConfig, count_parameters
from engine.data import Dataset, ImageCache, epoch_batches, split
from engine.inference.evaluate import exact_match
from engine.memory import apply_swap_core
from engine.model.registry import ensure_builtin, load_base, position_limit
from engine.spec import Reporter, Store, TrainResult
from engine.training.checkpointer import checkpointer_for
from engine.training.hyper import lr_lambda, resolve
from engine.training.objective import objective_for
from engine.training.optim import optimizer, update
from engine.training.ranks import ranks_for
from engine.training.step import accumulate, dpo_accumulate, dpo_evaluate, evaluate
from kiln.dataset import DatasetError, Issue, LengthBound, method_takes
from kiln.spec import JobSpec
from kiln.tokenizer import chat_template, load_tokenizer
from kiln_kernels.ahead import start_compilers, stop_compilers


class Trainer:
    def __init__(self, spec: JobSpec, store: Store, reporter: Reporter, work: Path, mesh=None):
        self.spec, self.store, self.reporter, self.work, self.mesh = spec, store, reporter, work, mesh
        self.ranks = ranks_for(mesh)
        self.objective = objective_for(spec)
        self.checkpointer = checkpointer_for(store, self.objective, self.ranks)
        self.step_no, self.tokens, self.skipped = 0, 0, 0
        self.saved = 0  # the step of the last checkpoint
        self.rehearsed = False  # the first step's kernels compiled ahead (engine.training.step.rehearse)
        self.metrics: dict[str, float] = {}
        self.order: tuple[int, list[list[int]]] = (-1, [])

    def setup(self) -> None:
        """The base model, the data, what trains, the model's placement, the optimizer; a resume."""
        spec, reporter = self.spec, self.reporter
        self.model_dir = model_dir = self.store.model_dir(spec.model)
        ensure_builtin(spec.model, model_dir)
        if not (model_dir / "config.json").exists():
            raise ValueError(f"base model {spec.model!r} has no weights in {model_dir}")
        if accelerator.accelerated(self.ranks.device):  # they start while the checkpoint loads
            start_compilers()  # (the first step's compiles: engine.training.step.rehearse)
        self.model = model = load_base(model_dir)
        if spec.parallel.cp_size > 1 and not getattr(model, "supports_context_parallel", False):
            raise ValueError(f"parallel.cp_size: {spec.model} has no context-parallel form yet; use 1")
        self._data(model)

        torch.manual_seed(spec.seed)
        self.objective.prepare(model)
        model.train()
        self.swap = apply_swap_core(model, spec.memory)
        total_params = sum(p.numel() for p in model.parameters())  # counted whole, before any sharding
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.ranks.place(model, self.objective.full, reporter)
        if self.swap is not None:
            m = spec.memory
            reporter.message(
                f"Recompute: {m.recompute}"
                + (
                    f", keeping {', '.join(m.cache_ops)} outputs on the {m.tier} tier"
                    + (f" as {m.quantize}" if m.quantize != "none" else "")
                    if m.recompute == "selective"
                    else ""
                ),
                data=m.model_dump(),
            )
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._describe(total_params, n_train)

        self.opt = optimizer(self.trainable, self.hp.learning_rate)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.hp.warmup_steps, self.hp.total_steps))
        if spec.resume_from:
            self.step_no, self.tokens = self.checkpointer.resume(spec.resume_from, model, self.opt, self.sched)
            self.saved = self.step_no
            reporter.message(f"Resumed from the checkpoint at step {self.step_no}", data={"step": self.step_no})
        elif spec.init_adapter:  # a job continued from another's fine-tune: its adapter, a fresh optimizer
            self.objective.load(model, self.store.path(spec.init_adapter))
            reporter.message(f"Started from the adapter in {spec.init_adapter}")

    def _data(self, model: torch.nn.Module) -> None:
        """The tokenizer, the training and validation sets under the job's length bound (the
        API's rule, kiln.dataset), the packed rows' length and the resolved hyperparameters."""
        spec = self.spec
        tok = load_tokenizer(self.model_dir)
        self.tpl = tpl = chat_template(tok)
        length = LengthBound(spec.model, position_limit(model), spec.max_seq_len)
        image_size, image_tokens = (
            getattr(model, "image_size", 0),
            getattr(model, "image_tokens", None),
        )  # None: text only
        self.reporter.message("Indexing the dataset")
        cache = ImageCache(image_size)
        self.train_set = Dataset(
            spec.training_file, spec.images_file, tok, tpl, image_size, image_tokens, length, self.work, cache
        )
        wrong = method_takes(spec.method, bool(self.train_set.pairs))
        if wrong:
            raise DatasetError([Issue(0, "", wrong)])
        self.beta = 0.1 if spec.beta == "auto" else spec.beta  # DPO's; TRL's and OpenAI's default
        self.train_idx, self.valid_idx = split(len(self.train_set), spec.validation_split, spec.seed)
        self.valid_set = self.train_set
        if spec.validation_file:
            self.valid_set = Dataset(
                spec.validation_file, spec.images_file, tok, tpl, image_size, image_tokens, length, self.work, cache
            )
            self.valid_idx = list(range(len(self.valid_set)))
            if self.valid_set.pairs != self.train_set.pairs:
                raise DatasetError([Issue(0, "", "the validation file and the training file hold different kinds")])
        # rows of the job's bound; without one (no position limit, no max_seq_len) of the longest example
        max_len = length.bound or max(max(d.lengths) for d in {self.train_set, self.valid_set})
        self.pack_to = max_len if spec.packing else None
        self.hp = resolve(spec, len(self.train_idx))

    def _describe(self, total_params: int, n_train: int) -> None:
        spec, hp = self.spec, self.hp
        tokens_per_epoch = sum(self.train_set.lengths[i] for i in self.train_idx)
        if isinstance(
            self.model.config, ModelConfig
        ):  # the hybrid family counts from its config: active parameters too
            counts = count_parameters(self.model.config)
            self.reporter.message(
                f"{spec.model}: {counts['total']:,} parameters, {counts['active']:,} active per token", data=counts
            )
        self.reporter.message(
            f"Model {spec.model}: {total_params:,} parameters, LoRA trains {n_train:,} "
            f"({100 * n_train / total_params:.2f}%); {len(self.train_idx)} training examples "
            f"({tokens_per_epoch:,} tokens), {len(self.valid_idx)} validation examples, {hp.total_steps} steps "
            f"on {self.ranks.where()}" + (f", packed into rows of {self.pack_to} tokens" if self.pack_to else ""),
            data={
                "total_parameters": total_params,
                "trainable_parameters": n_train,
                "tokens_per_epoch": tokens_per_epoch,
            },
        )
        self.reporter.resolved(hp.public())

    def step(self) -> dict:
        """One optimizer step over the next batch of the epoch's order; its metrics."""
        t0 = time.perf_counter()
        hp, spec = self.hp, self.spec
        epoch, index = divmod(self.step_no, hp.steps_per_epoch)
        if self.order[0] != epoch:
            self.order = (
                epoch,
                epoch_batches(
                    self.train_set.lengths, self.train_idx, hp.batch_size, spec.seed, epoch, spec.group_by_length
                ),
            )
        samples = [self.train_set[i] for i in self.order[1][index]]
        dpo = {}
        if spec.method == "dpo":
            dpo = dpo_accumulate(
                self.model, samples, self.beta, self.tpl.pad_id, self.ranks.device, ahead=not self.rehearsed
            )
            loss, n, right, seen, rows = torch.tensor(dpo.pop("train_loss")), 0, torch.tensor(0), dpo.pop("tokens"), 0
        else:
            loss, n, right, seen, rows = accumulate(
                self.model,
                samples,
                spec.gradient_accumulation_steps,
                self.tpl.pad_id,
                self.pack_to,
                self.ranks,
                ahead=not self.rehearsed,  # the process's first step compiles its kernels side by side
            )
        self.rehearsed = True
        grad_norm, finite = update(self.opt, self.trainable, self.ranks)
        self.objective.after_update(self.model, self.ranks)
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if not finite:  # read once the update is queued
            self.skipped += 1
            self.reporter.message(
                f"Step {self.step_no + 1}: the gradient is not finite; the update was skipped ({self.skipped} so far)",
                level="warn",
                data={"step": self.step_no + 1, "skipped_steps": self.skipped},
            )
        self.step_no += 1
        self.tokens += seen
        metrics = {
            "step": self.step_no,
            "total_steps": hp.total_steps,
            "epoch": epoch + 1,
            "train_loss": float(loss),
            **(dpo or {"train_mean_token_accuracy": int(right) / max(n, 1)}),
            "learning_rate": self.sched.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "step_seconds": (seconds := time.perf_counter() - t0),
            "tokens_per_second": seen / seconds,
            "trained_tokens": self.tokens,
            "rows": rows,
            "skipped_steps": self.skipped,
            "peak_memory_mb": accelerator.peak_memory_mb(self.ranks.device),
        }
        if self.swap is not None and self.swap.ops:  # what Swap Core kept at its fullest this step
            metrics.update({f"swap_{tier}_mb": self.swap.peak[tier] / 2**20 for tier in ("device", "host")})
            self.swap.reset_peaks()
        return metrics

    def evaluate(self) -> dict:
        if self.spec.method == "dpo":
            return dpo_evaluate(
                self.model, self.valid_set, self.valid_idx, self.beta, self.tpl.pad_id, self.ranks.device
            )
        return evaluate(
            self.model, self.valid_set, self.valid_idx, self.hp.batch_size, self.tpl.pad_id, self.pack_to, self.ranks
        )

    def final_evaluation(self, metrics: dict) -> dict:
        """The finished model on the whole validation set, OpenAI's names (``full_valid_loss``,
        ``full_valid_mean_token_accuracy``), and for a chat model in one process the share of
        validation prompts it answers exactly as the reference does (``full_valid_exact_match``,
        engine.inference.evaluate: greedy, with the decode cache)."""
        if self.spec.method == "dpo":
            return {}
        out = {
            "full_valid_loss": metrics["valid_loss"],
            "full_valid_mean_token_accuracy": metrics["valid_mean_token_accuracy"],
        }
        if self.mesh is None:
            out["full_valid_exact_match"] = exact_match(self.model, self.valid_set, self.valid_idx)
        return out

    def checkpoint(self, metrics: dict) -> None:
        step = self.saved = self.step_no
        key = f"{self.spec.artifacts}/checkpoints/step-{step:07d}"
        self.checkpointer.save(key, self.model, self.opt, self.sched, step, self.tokens)
        kept = ("loss", "accuracy", "exact_match")
        self.reporter.checkpoint(step, key, {k: v for k, v in metrics.items() if any(w in k for w in kept)})

    def run(self) -> TrainResult:
        self.setup()
        gc.collect()
        gc.freeze()  # see the module's docstring
        try:
            while self.step_no < self.hp.total_steps:
                reason = self.ranks.stop(self.reporter)
                if reason:
                    if reason == "pause" and self.saved < self.step_no:  # resume continues from here
                        self.checkpoint(self.metrics)
                    return TrainResult(
                        "stopped", trained_tokens=self.tokens, stop_reason=reason, final_metrics=self.metrics
                    )
                self.metrics = metrics = self.step()
                step = self.step_no
                is_ckpt = step % self.hp.checkpoint_interval == 0 or step == self.hp.total_steps
                if is_ckpt and self.valid_idx:
                    metrics.update(self.evaluate())
                    if step == self.hp.total_steps:
                        metrics.update(self.final_evaluation(metrics))
                self.reporter.metrics(step, metrics)
                if is_ckpt:
                    self.checkpoint(metrics)
        finally:
            for d in {self.train_set, self.valid_set}:
                d.close()
        return self.objective.finish(
            self.model, self.ranks, self.store, self.model_dir, self.step_no, self.hp, self.tokens, self.metrics
        )


def train(spec: JobSpec, store: Store, reporter: Reporter, mesh=None) -> TrainResult:
    """Train as ``spec`` says. With ``mesh`` (engine.parallel.mesh.Mesh, under torchrun) every rank
    calls this; only rank 0's reporter is heard, and rank 0's answer to ``should_stop`` holds for all."""
    with tempfile.TemporaryDirectory(prefix="kiln-job-") as work:
        try:
            return Trainer(spec, store, reporter, Path(work), mesh).run()
        finally:
            gc.unfreeze()
            stop_compilers()  # (a job that ended before its first step's rehearsal)
