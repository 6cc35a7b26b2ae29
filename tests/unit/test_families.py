"""The model families behind one registry against the catalog the API serves: every card
(kiln.catalog, torch-free) belongs to a built-in model of its family, names only real modules and
parameters of the model that family builds, and states the facts the family computes from its
config (experts, position limit, image tokens)."""

from __future__ import annotations

import pytest
from torch import nn

from engine.lora import apply_lora
from engine.model.registry import BUILTINS, FAMILIES, ensure_builtin, load_base
from kiln.catalog import CARDS, Targets
from kiln.spec import LoraSpec

BUILT_IN = {b.card.name: (family, b.card) for family in FAMILIES.values() for b in family.builtins}


def check_targets(model: nn.Module, targets: Targets) -> None:
    """Every target names a linear layer of the model (LoRA wraps each), every expert parameter a
    grouped expert tensor, and the defaults are targets."""
    assert set(targets.defaults) <= set(targets.modules), set(targets.defaults) - set(targets.modules)
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(targets.modules) <= linear, set(targets.modules) - linear
    params = [name for name, _ in model.named_parameters()]
    for p in targets.parameters:
        assert any(name.endswith("." + p) for name in params), p
    wrapped = apply_lora(
        model, LoraSpec(rank=2, target_modules=list(targets.modules), target_parameters=list(targets.parameters))
    )
    assert {w.rsplit(".", 1)[-1] for w in wrapped if not w.endswith("mlp.experts")} == set(targets.modules)


def test_the_catalog_is_the_families_built_in_models():
    from api import catalog

    assert list(BUILT_IN) == list(CARDS) == list(BUILTINS)
    assert all(
        card is CARDS[name] and card.model_type == family.model_type for name, (family, card) in BUILT_IN.items()
    )
    assert catalog.BASE_MODELS == {name: card.row() for name, card in CARDS.items()}


@pytest.mark.parametrize("name", list(CARDS))
def test_a_cards_facts_are_the_built_models(name, tmp_path):
    family, card = BUILT_IN[name]
    ensure_builtin(name, tmp_path / name)
    model = load_base(tmp_path / name)
    assert card.lora is family.lora
    check_targets(model, card.lora)
    c = model.config
    grouped = {m.gate_up_proj.shape[0] for n, m in model.named_modules() if n.endswith("mlp.experts")}
    assert card.experts == family.experts(c) and grouped == ({card.experts} if card.experts else set())
    assert card.position_limit == family.position_limit(c)
    assert card.image_tokens == family.image_tokens(c) == getattr(model, "image_tokens", None)
    assert card.context_parallel == getattr(model, "supports_context_parallel", False)


def test_a_family_without_a_built_in_model_names_its_real_modules():
    """DeepSeek V3.2 (loaded as the hybrid, every layer Gated DSA): a small config.json."""
    family = FAMILIES["deepseek_v32"]
    raw = {
        "vocab_size": 200,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 6,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 1024,
    }
    model = family.build(raw)
    assert not family.builtins and family.save is None and isinstance(model, family.model_class)
    check_targets(model, family.lora)
    assert (family.experts(model.config), family.position_limit(model.config), family.image_tokens(model.config)) == (
        8,
        1024,
        None,
    )
