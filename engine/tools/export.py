"""Merge a LoRA adapter into its base model and write the result as a base model of the same
family, on disk in the family's own layout:

    python -m engine.tools.export --base DIR --adapter DIR_OR_ZIP --out DIR [--dtype base|float32|bfloat16|float16]

- ``--base``: the base model's folder (config.json + safetensors; what ``load_base`` reads).
- ``--adapter``: our adapter in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``),
  a folder or the zip the service hands out; expert LoRA (``target_parameters``) included.
- ``--out``: a new folder (refused when it exists and is not empty). Written beside it first and
  renamed into place, so a stopped export never looks complete.

The merge runs in float32 whatever the base's dtype (W + (alpha / r) B A, each expert's grouped
weight + its own B A): a bf16 base is widened first, so the sum is rounded once, when written.
``--dtype base`` (the default) writes each tensor in the dtype the base's file holds it in
(a bf16 base gives a bf16 model of the base's size; the built-in models are float32);
``float32``, ``bfloat16`` or ``float16`` write every floating tensor in that dtype (config.json's
``dtype`` / ``torch_dtype`` follow).

The folder holds the weights in the family's layout (``model.safetensors``: Kimi's for
kimi_linear, which transformers' ``kimi_linear`` loads; Kiln's module names for kiln_tiny and
kiln_hybrid, which only Kiln loads), the base's config.json as it was (its
``quantization_config`` dropped: the weights are never quantized), and every other non-weight
file of the base (tokenizer, chat template, generation config, remote code) as is. A family with
no writer of its own layout (deepseek_v32) is refused.

Memory: the whole model is loaded on the CPU in float32 (4 bytes a parameter, plus one
family-layout copy while the file is written); a streaming, tensor-by-tensor merge for models
larger than host memory is not built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from engine.lora import ExpertsLoRA, LoRALinear, apply_lora, load_adapter, merge
from engine.model.common.hf import shards
from engine.model.registry import FAMILIES, load_base
from kiln.spec import LoraSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class Exported:
    """What was written: config.json's ``model_type``, the dtypes of the floating tensors, and
    the folder's files."""

    model_type: str
    dtypes: tuple[str, ...]
    files: tuple[str, ...]


def lora_spec(adapter: Path) -> LoraSpec:
    """The adapter's settings from its ``adapter_config.json`` (PEFT's names). Refuses what a
    merge here would get wrong: DoRA, rsLoRA, per-layer ranks or alphas, modules saved whole."""
    path = adapter / "adapter_config.json"
    if not path.exists():
        raise ValueError(f"{adapter}: no adapter_config.json (an adapter in PEFT's layout is expected)")
    c = json.loads(path.read_text())
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {c['peft_type']!r}; only LORA adapters merge here")
    for key in ("use_dora", "use_rslora"):
        if c.get(key):
            raise ValueError(f"{path}: {key} is set; only plain LoRA (scale alpha / r) merges here")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if c.get(key):
            raise ValueError(f"{path}: {key} is set; only one rank and alpha for every layer merge here")
    modules = c.get("target_modules")
    if not isinstance(modules, list) or not modules:
        raise ValueError(f"{path}: target_modules must be a list of layer names, got {modules!r}")
    return LoraSpec(
        rank=int(c["r"]),
        alpha=float(c["lora_alpha"]),
        target_modules=[str(m) for m in modules],
        target_parameters=[str(p) for p in c.get("target_parameters") or []],
    )


@torch.no_grad()
def merged_model(base: Path, adapter: Path) -> nn.Module:
    """The base with the adapter folded into its weights in float32, as plain modules again (no
    LoRA wrappers left, so its state dict has the base's names)."""
    spec = lora_spec(adapter)
    model = load_base(base).float().eval()
    apply_lora(model, spec)
    try:
        load_adapter(model, adapter)
    except RuntimeError as e:  # a factor whose shape is not the layer's: another model's adapter
        raise ValueError(f"{adapter}: the adapter does not fit {base}: {e}") from e
    merge(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.base)
        elif isinstance(module, ExpertsLoRA):
            delattr(model.get_submodule(name.removesuffix(".lora")), "lora")
    assert not any(isinstance(m, (LoRALinear, ExpertsLoRA)) for m in model.modules())
    return model


def disk_dtypes(folder: Path) -> dict[str, torch.dtype]:
    """Each floating tensor's dtype in a safetensors folder, read from the headers only."""
    out = {}
    for path in shards(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                kind = f.get_slice(key).get_dtype()
                if kind in _SAFETENSORS_DTYPES:
                    out[key] = _SAFETENSORS_DTYPES[kind]
    return out


def _cast_file(path: Path, want: dict[str, torch.dtype], fallback: torch.dtype | None) -> set[torch.dtype]:
    """Rewrite a safetensors file with each floating tensor in ``want[key]`` (else ``fallback``;
    None: as it is). Returns the floating dtypes written."""
    tensors = load_file(str(path))
    written = set()
    for key, t in tensors.items():
        if t.is_floating_point():
            dt = want.get(key, fallback) or t.dtype
            tensors[key] = t.to(dt)
            written.add(dt)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return written


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _base_config(base: Path, dtype: str) -> tuple[dict, Callable[[nn.Module, Path], None]]:
    """The base's config.json and its family's writer; refuses a family with none, or a bad dtype."""
    if not (base / "config.json").exists():
        raise ValueError(f"{base}: no config.json (a base model's folder is expected)")
    config = json.loads((base / "config.json").read_text())
    kind = config.get("model_type")
    family = FAMILIES.get(kind) if isinstance(kind, str) else None
    if family is None or family.save is None:
        writers = ", ".join(k for k, f in FAMILIES.items() if f.save is not None)
        raise ValueError(f"{base}: model_type {kind!r} has no writer of its own layout; export supports {writers}")
    if dtype != "base" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected base or one of {', '.join(DTYPES)}")
    return config, family.save


def write_merged(model: nn.Module, base: Path, out: Path, dtype: str = "base") -> Exported:
    """Write a merged model (``merged_model``) into the empty folder ``out``: the weights in the
    base family's layout and dtype (``dtype``: base, float32, bfloat16 or float16), the base's
    config.json and its other non-weight files."""
    config, save = _base_config(base, dtype)
    kind = config["model_type"]
    save(model, out)
    if dtype == "base":
        on_disk = disk_dtypes(base)
        common = Counter(on_disk.values()).most_common(1)
        want, fallback = on_disk, (common[0][0] if common else None)
    else:
        want, fallback = {}, DTYPES[dtype]
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype
    written: set[torch.dtype] = set()
    for path in sorted(out.glob("*.safetensors")):
        written |= _cast_file(path, want, fallback)
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in sorted(base.iterdir()):
        weights = p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json")
        if p.is_file() and not weights and p.name != "config.json":
            shutil.copy2(p, out / p.name)
    return Exported(
        model_type=kind,
        dtypes=tuple(sorted(_dtype_name(d) for d in written)),
        files=tuple(sorted(p.name for p in out.iterdir())),
    )


@contextmanager
def adapter_folder(adapter: Path) -> Iterator[Path]:
    """The adapter as a folder: itself, or a zip's contents unpacked into a temporary one."""
    if adapter.is_dir():
        yield adapter
        return
    if not zipfile.is_zipfile(adapter):
        raise ValueError(f"{adapter}: not a folder or a zip holding an adapter")
    with tempfile.TemporaryDirectory(prefix="kiln-adapter-") as tmp:
        with zipfile.ZipFile(adapter) as zf:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                if name not in zf.namelist():
                    raise ValueError(f"{adapter}: the zip has no {name}")
                zf.extract(name, tmp)
        yield Path(tmp)


def export(base: Path, adapter: Path, out: Path, dtype: str = "base") -> Exported:
    """Merge ``adapter`` (a folder or a zip) into ``base`` and write the result to ``out`` (a
    new or empty folder), atomically: written to a sibling folder and renamed into place."""
    base, adapter, out = Path(base), Path(adapter), Path(out)
    _base_config(base, dtype)  # before loading anything
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        with adapter_folder(adapter) as folder:
            info = write_merged(merged_model(base, folder), base, tmp, dtype)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.tools.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", type=Path, required=True, help="the base model's folder")
    p.add_argument("--adapter", type=Path, required=True, help="the adapter: a PEFT folder or its zip")
    p.add_argument("--out", type=Path, required=True, help="the merged model's folder (new or empty)")
    p.add_argument(
        "--dtype",
        default="base",
        choices=["base", *DTYPES],
        help="the weights' dtype on disk (default: each tensor as the base holds it)",
    )
    a = p.parse_args(argv)
    try:
        info = export(a.base, a.adapter, a.out, a.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{info.model_type} model, {'/'.join(info.dtypes)}, merged -> {a.out}: {', '.join(info.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
