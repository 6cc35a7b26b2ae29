"""LoRA on linear layers: y = W x + (alpha / r) * B(A(dropout(x))), W frozen and never copied.

Saved in PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` ([r, in]) and ``.lora_B.weight`` ([out, r]).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.spec import LoraSpec

PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Freeze the model and wrap every nn.Linear whose last name is a target. Returns the paths."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in spec.target_modules and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, spec.rank, spec.alpha, spec.dropout))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    missing = set(spec.target_modules) - {w.rsplit(".", 1)[-1] for w in wrapped}
    if missing:
        raise ValueError(f"lora.target_modules: the model has no linear layer named {', '.join(sorted(missing))}")
    return wrapped


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's key names."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_A.weight.detach().contiguous().cpu()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_B.weight.detach().contiguous().cpu()
    return out


def load_lora_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    modules = dict(model.named_modules())
    seen = set()
    for key, tensor in state.items():
        path, part = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        module = modules.get(path)
        if not isinstance(module, LoRALinear):
            raise ValueError(f"adapter key {key} matches no LoRA layer of the model")
        getattr(module, part).weight.data.copy_(tensor)
        seen.add(path)
    expected = {n for n, m in modules.items() if isinstance(m, LoRALinear)}
    if seen != expected:
        raise ValueError(f"adapter lacks {sorted(expected - seen)[:5]}")


def save_adapter(model: nn.Module, spec: LoraSpec, base_model: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(lora_state(model), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
        "layers_to_transform": None, "layers_pattern": None, "revision": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))


def load_adapter(model: nn.Module, folder: Path) -> None:
    load_lora_state(model, load_file(str(folder / "adapter_model.safetensors")))
