"""What a job trains: ``LoRA`` (adapters on a frozen base) or ``Full`` (every weight; the
routers rebalance too), what a checkpoint holds of it and what the job's result is. DPO slots in
here as another objective."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.lora import apply_lora, load_adapter, save_adapter
from engine.model.common.moe import Router
from engine.model.registry import save_base
from engine.spec import Store, TrainResult
from engine.training.hyper import Resolved
from kiln.spec import JobSpec


class LoRA:
    full = False

    def __init__(self, spec: JobSpec):
        self.spec = spec

    def prepare(self, model: torch.nn.Module) -> None:
        apply_lora(model, self.spec.lora)

    def trained_names(self, model: torch.nn.Module) -> set[str]:
        """The parameters a sharded checkpoint gathers for rank 0's adapter."""
        return {n for n, p in model.named_parameters() if p.requires_grad}

    def save(self, model: torch.nn.Module, folder: Path, gathered: dict | None = None) -> None:
        save_adapter(model, self.spec.lora, self.spec.model, folder, gathered)

    def load(self, model: torch.nn.Module, folder: Path) -> None:
        load_adapter(model, folder)

    def after_update(self, model: torch.nn.Module, ranks) -> None:
        pass

    def finish(
        self, model, ranks, store: Store, model_dir: Path, step: int, hp: Resolved, tokens: int, metrics: dict
    ) -> TrainResult:
        """The adapter of the last checkpoint, zipped with a model card (rank 0)."""
        spec = self.spec
        adapter_key = f"{spec.artifacts}/adapter.zip"
        if not ranks.rank0:
            return TrainResult("succeeded", adapter_key=adapter_key, trained_tokens=tokens, final_metrics=metrics)
        final = store.path(f"{spec.artifacts}/checkpoints/step-{step:07d}")
        with store.publish_file(adapter_key) as path:
            with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
                for name in ("adapter_config.json", "adapter_model.safetensors"):
                    zf.write(final / name, name)
                zf.writestr(
                    "README.md", model_card(spec, hp, {k: round(v, 4) for k, v in metrics.items() if "loss" in k})
                )
        return TrainResult("succeeded", adapter_key=adapter_key, trained_tokens=tokens, final_metrics=metrics)


class Full(LoRA):
    full = True

    def prepare(self, model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.requires_grad_(True)

    def save(self, model: torch.nn.Module, folder: Path, gathered: dict | None = None) -> None:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
            str(folder / "model_state.safetensors"),
        )

    def load(self, model: torch.nn.Module, folder: Path) -> None:
        model.load_state_dict(load_file(str(folder / "model_state.safetensors")))

    def after_update(self, model: torch.nn.Module, ranks) -> None:
        """The base model itself learns: its routers rebalance too."""
        ranks.sync_routers(model)
        for m in model.modules():
            if isinstance(m, Router):
                m.update_bias(self.spec.moe_bias_rate)

    def finish(
        self, model, ranks, store: Store, model_dir: Path, step: int, hp: Resolved, tokens: int, metrics: dict
    ) -> TrainResult:
        """The whole trained model in its family's on-disk format, loadable as a base model."""
        key = f"{self.spec.artifacts}/model"
        whole = ranks.whole(model, model_dir)
        if whole is not None:
            with store.publish_dir(key) as folder:
                save_base(whole, folder)
        return TrainResult("succeeded", adapter_key=key, trained_tokens=tokens, final_metrics=metrics)


def objective_for(spec: JobSpec) -> LoRA:
    return Full(spec) if spec.training == "full" else LoRA(spec)


def model_card(spec: JobSpec, hp: Resolved, metrics: dict) -> str:
    lines = [
        f"# LoRA adapter for {spec.model}",
        "",
        f"Trained by Kiln job `{spec.job_id}`.",
        "",
        "```python",
        "from peft import PeftModel",
        "model = PeftModel.from_pretrained(base_model, 'this-folder')",
        "```",
        "",
        "| setting | value |",
        "| --- | --- |",
    ]
    for k, v in {
        **hp.public(),
        "lora_rank": spec.lora.rank,
        "lora_alpha": spec.lora.alpha,
        "target_modules": ", ".join(spec.lora.target_modules),
        **metrics,
    }.items():
        lines.append(f"| {k} | {v} |")
    return "\n".join(lines) + "\n"
