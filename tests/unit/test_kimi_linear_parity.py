"""Our Kimi Linear against transformers' kimi_linear on a small random checkpoint saved by
transformers itself (sharded), loaded through our loader: logits within fp32 rel err 1e-4."""

from __future__ import annotations

import pytest
import torch

from engine.model.common.hf import shards
from engine.model.kimi_linear import load_kimi_linear

transformers = pytest.importorskip("transformers")


def tiny_config(**kw):
    base = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        linear_head_dim=16,
        linear_num_heads=4,
        routed_scaling_factor=2.446,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.KimiLinearConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    ref = transformers.KimiLinearForCausalLM(tiny_config()).eval()
    with torch.no_grad():  # give every parameter a value that matters, not its init
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08))
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    folder = tmp_path_factory.mktemp("kimi")
    ref.save_pretrained(folder, max_shard_size="100KB")
    return ref, folder


@pytest.mark.parametrize("T", [37, 150])
def test_logits_match_transformers(saved, T):
    ref, folder = saved
    assert len(shards(folder)) > 1  # the sharded index path is the one exercised
    ours = load_kimi_linear(folder).eval()
    ids = torch.randint(3, 300, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-4, rel


def test_grouped_experts_and_conv_come_from_the_disk_layout(saved):
    ref, folder = saved
    ours = load_kimi_linear(folder)
    theirs = dict(ref.named_parameters())
    mine = dict(ours.named_parameters())
    assert torch.equal(
        mine["model.layers.1.mlp.experts.gate_up_proj"], theirs["model.layers.1.mlp.experts.gate_up_proj"]
    )
    assert torch.equal(mine["model.layers.0.self_attn.conv1d.weight"], theirs["model.layers.0.self_attn.conv1d.weight"])
    assert not any(p.is_meta for p in ours.parameters())
    assert set(mine) == set(theirs)  # the same names as transformers' module tree: PEFT's keys


def test_packed_documents_equal_each_alone(saved):
    _, folder = saved
    model = load_kimi_linear(folder, dtype=torch.float64).eval()
    lens = [20, 70, 9]
    ids = torch.randint(3, 300, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]
    with torch.no_grad():
        packed = model(ids, doc_ids_BT=docs)
        at = 0
        for n in lens:  # KDA state, short convolutions and attention all restart per document
            alone = model(ids[:, at : at + n])
            assert float((packed[:, at : at + n] - alone).norm() / alone.norm()) < 1e-10
            at += n


def test_our_adapter_loads_in_peft_and_gives_our_logits(saved, tmp_path):
    """LoRA on attention projections and on every expert, exported in PEFT's layout; PEFT puts it
    on the transformers model and the logits agree."""
    peft = pytest.importorskip("peft")
    from engine.lora import apply_lora, load_adapter, lora_state, save_adapter
    from kiln.spec import LoraSpec

    ref, folder = saved
    spec = LoraSpec(
        rank=4,
        alpha=8.0,
        target_modules=["q_proj", "o_proj", "g_b_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    ours = load_kimi_linear(folder).eval()
    apply_lora(ours, spec)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:  # B starts at zero: give every factor a value
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    assert all(p.requires_grad == ("lora" in n) for n, p in ours.named_parameters())
    save_adapter(ours, spec, "kimi-tiny", tmp_path / "adapter")
    ids = torch.randint(3, 300, (2, 70), generator=g)
    with torch.no_grad():
        mine = ours(ids)
        base = transformers.KimiLinearForCausalLM.from_pretrained(folder).eval()
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        plain = load_kimi_linear(folder).eval()(ids)
    assert float((mine - plain).norm() / plain.norm()) > 1e-3  # the adapter changes the model
    assert float((mine - theirs).norm() / theirs.norm()) < 1e-4
    again = load_kimi_linear(folder).eval()
    apply_lora(again, spec)
    load_adapter(again, tmp_path / "adapter")
    assert all(torch.equal(a, b) for a, b in zip(lora_state(again).values(), lora_state(ours).values(), strict=True))


def test_to_hf_round_trips_and_transformers_reads_it(saved, tmp_path):
    from engine.model.kimi_linear import save_kimi_linear

    ref, folder = saved
    ours = load_kimi_linear(folder).eval()
    save_kimi_linear(ours, tmp_path / "again")
    back = load_kimi_linear(tmp_path / "again").eval()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values(), strict=True))
    theirs = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "again").eval()
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((theirs(ids).logits - ref(ids).logits).norm() / ref(ids).logits.norm()) < 1e-6


def test_config_in_the_hubs_own_form(saved, tmp_path):
    """Kimi Linear's published config.json names its layers in linear_attn_config (1-based) and
    its dense layers by first_k_dense_replace; transformers rewrites both when it saves."""
    import json
    import shutil

    from engine.model.kimi_linear import KimiLinearConfig

    ref, folder = saved
    d = json.loads((folder / "config.json").read_text())
    hub = {
        k: v
        for k, v in d.items()
        if k not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
    }
    hub["linear_attn_config"] = {
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
    }
    hub["first_k_dense_replace"] = 1
    assert KimiLinearConfig.from_hf(hub) == KimiLinearConfig.from_hf(d)
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text(json.dumps(hub))
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert float((load_kimi_linear(tmp_path)(ids) - ref(ids).logits).norm() / ref(ids).logits.norm()) < 1e-4
