"""engine.tools.export: a merged export loads through load_base and gives base + adapter's logits;
Kimi Linear's loads in transformers with ours, and equals PEFT's adapter on transformers' base;
a bf16 base is merged in fp32 and rounded once; the command line and its refusals."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.lora import PEFT_PREFIX, apply_lora, save_adapter
from engine.model.registry import ensure_builtin, load_base
from engine.tools.export import disk_dtypes, export, main
from kiln import catalog
from kiln.spec import LoraSpec

SPECS = {
    "kiln-tiny": LoraSpec(rank=4, alpha=8.0, target_modules=list(catalog.TINY.modules)),
    "kimi-linear-tiny": LoraSpec(  # every layer LoRA may wrap, and every expert
        rank=4,
        alpha=8.0,
        target_modules=list(catalog.KIMI_LINEAR.modules),
        target_parameters=list(catalog.EXPERT_PARAMETERS),
    ),
    "kiln-hybrid-tiny": LoraSpec(
        rank=4,
        alpha=8.0,
        target_modules=list(catalog.HYBRID.modules),
        target_parameters=list(catalog.EXPERT_PARAMETERS),
    ),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def ids(seed: int, T: int = 41) -> torch.Tensor:
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(seed))


def adapted(base: Path, spec: LoraSpec, seed: int = 7) -> torch.nn.Module:
    """The base with LoRA whose every factor is random (B starts at zero: it must not stay so)."""
    model = load_base(base).eval()
    apply_lora(model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """name -> (base folder, adapter folder, the adapted model unmerged)."""
    root = tmp_path_factory.mktemp("builtins")
    made = {}

    def get(name: str):
        if name not in made:
            base = root / name
            ensure_builtin(name, base)
            model = adapted(base, SPECS[name])
            save_adapter(model, SPECS[name], name, root / f"{name}-adapter")
            made[name] = base, root / f"{name}-adapter", model
        return made[name]

    return get


@pytest.mark.parametrize("name", list(SPECS))
def test_the_export_loads_and_gives_base_plus_adapter(builtin, name, tmp_path):
    base, adapter, model = builtin(name)
    info = export(base, adapter, tmp_path / "merged")
    assert (
        info.dtypes == ("float32",) and info.model_type == json.loads((base / "config.json").read_text())["model_type"]
    )
    assert json.loads((tmp_path / "merged" / "config.json").read_text()) == json.loads(
        (base / "config.json").read_text()
    )
    assert disk_dtypes(tmp_path / "merged").keys() == disk_dtypes(base).keys()  # the base's layout, key for key
    merged = load_base(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    x = ids(1)
    with torch.no_grad():
        want, got, plain = model(x), merged(x), load_base(base).eval()(x)
    assert rel(want, plain) > 0.1  # the adapter changes the model: the comparison below can fail
    assert rel(got, want) < 1e-5  # fp32: (W + s B A) x against W x + s B (A x), rounding apart


def test_kimi_linear_export_loads_in_transformers_and_equals_peft(builtin, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, adapter, model = builtin("kimi-linear-tiny")
    export(base, adapter, tmp_path / "merged")
    x = ids(2, 70)
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert type(theirs).__name__ == "KimiLinearForCausalLM"
        got = theirs(x).logits
        ours = load_base(tmp_path / "merged").eval()(x)
        unmerged = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base).eval(), adapter
        ).eval()
        with_peft = unmerged(x).logits
        plain = load_base(base).eval()(x)
    assert rel(ours, plain) > 0.1
    assert rel(got, ours) < 1e-4  # transformers' kimi_linear against ours, one checkpoint
    assert rel(got, with_peft) < 1e-5  # the merge is PEFT's adapter on the same base


def test_a_bf16_base_is_merged_in_fp32_and_rounded_once(builtin, tmp_path):
    """Each tensor written in the dtype the base holds it in; the merged weight is the fp32 sum
    W + s B A rounded to bf16 once. --dtype float32 keeps the fp32 sum and says so in config.json."""
    base, adapter, _ = builtin("kiln-tiny")
    half = tmp_path / "bf16"
    half.mkdir()
    save_file(
        {k: v.to(torch.bfloat16) for k, v in load_file(base / "model.safetensors").items()}, half / "model.safetensors"
    )
    config = {**json.loads((base / "config.json").read_text()), "torch_dtype": "bfloat16"}
    (half / "config.json").write_text(json.dumps(config))
    (half / "tokenizer_config.json").write_text("{}")  # a side file travels with the weights

    info = export(half, adapter, tmp_path / "out")
    assert info.dtypes == ("bfloat16",) and "tokenizer_config.json" in info.files
    assert set(disk_dtypes(tmp_path / "out").values()) == {torch.bfloat16}
    wide = export(half, adapter, tmp_path / "wide", dtype="float32")
    assert wide.dtypes == ("float32",)
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["torch_dtype"] == "float32"

    factors = load_file(adapter / "adapter_model.safetensors")
    path = "model.layers.0.self_attn.q_proj"
    A, B = factors[f"{PEFT_PREFIX}{path}.lora_A.weight"], factors[f"{PEFT_PREFIX}{path}.lora_B.weight"]
    W = load_file(half / "model.safetensors")[f"{path}.weight"]
    fp32_sum = W.float() + (B @ A) * (8.0 / 4)
    with safe_open(str(tmp_path / "wide" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(f"{path}.weight"), fp32_sum)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(f"{path}.weight"), fp32_sum.to(torch.bfloat16))
    assert not torch.equal(fp32_sum.to(torch.bfloat16), W)  # the adapter moved this weight


def test_the_command_line_takes_the_adapter_zip(builtin, tmp_path, capsys):
    base, adapter, model = builtin("kimi-linear-tiny")
    archive = tmp_path / "adapter.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(adapter / name, name)
    assert main(["--base", str(base), "--adapter", str(archive), "--out", str(tmp_path / "m")]) == 0
    assert "kimi_linear model, float32, merged ->" in capsys.readouterr().out
    with torch.no_grad():
        assert rel(load_base(tmp_path / "m").eval()(ids(3)), model(ids(3))) < 1e-5


def test_refusals_name_the_problem(builtin, tmp_path, capsys):
    tiny_base, tiny_adapter, _ = builtin("kiln-tiny")
    kimi_base, _, _ = builtin("kimi-linear-tiny")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (
            ["--base", str(tiny_base), "--adapter", str(tiny_adapter), "--out", str(tmp_path / "full")],
            "is not an empty",
        ),
        (
            ["--base", str(kimi_base), "--adapter", str(tiny_adapter), "--out", str(tmp_path / "a")],
            "the adapter does not fit",
        ),
        (["--base", str(tiny_base), "--adapter", str(tmp_path / "full"), "--out", str(tmp_path / "b")], "no adapter_c"),
        (["--base", str(tmp_path), "--adapter", str(tiny_adapter), "--out", str(tmp_path / "c")], "no config.json"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a-*"))  # nothing left of a failed export

    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    with pytest.raises(ValueError, match="model_type 'deepseek_v32' has no writer of its own layout"):
        export(deepseek, tiny_adapter, tmp_path / "d")

    dora = tmp_path / "dora"
    shutil.copytree(tiny_adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora is set"):
        export(tiny_base, dora, tmp_path / "e")
