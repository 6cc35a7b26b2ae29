"""The hybrid family: config round trip, parameter counting against the built model (the
flagship too, on the meta device), and the debug model's forward, packing and training."""

from __future__ import annotations

from typing import cast

import torch

from engine.config import ModelConfig, count_parameters
from engine.lora import apply_lora
from engine.model.common.kda import KimiDeltaAttention
from engine.model.hybrid import HybridForCausalLM
from engine.model.hybrid.model import HybridLayer
from kiln.spec import LoraSpec
from kiln.tokenizer import ByteTokenizer

IMAGE = ByteTokenizer().special("<|image|>")


def build(c: ModelConfig, seed: int = 0, dtype=torch.float64) -> HybridForCausalLM:
    torch.manual_seed(seed)
    m = HybridForCausalLM(c, image_token_id=IMAGE).to(dtype)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in n else 0.0))
        for layer in cast("list[HybridLayer]", m.layers):
            if isinstance(layer.self_attn, KimiDeltaAttention):
                layer.self_attn.forget_gate.A_log.zero_()
    return m


def test_config_round_trips_and_the_flagship_has_its_shape():
    for c in (ModelConfig.debug(), ModelConfig.flagship()):
        assert ModelConfig.from_json(c.to_json()) == c
    f = ModelConfig.flagship()
    kinds = f.layer_kinds
    assert kinds.count("kda") == 69 and kinds.count("dsa") == 24 and kinds[-1] == "dsa" and kinds[3] == "dsa"


def test_counting_matches_the_built_models():
    for c in (ModelConfig.debug(), ModelConfig.flagship()):
        with torch.device("meta"):  # the flagship's 2.8T parameters cost nothing here
            m = HybridForCausalLM(c, image_token_id=IMAGE)
        counted = count_parameters(c)
        assert counted["total"] == sum(p.numel() for p in m.parameters()), c.layers
    f = count_parameters(ModelConfig.flagship())
    assert abs(f["total"] / 2.8e12 - 1) < 0.02  # K3's published 2.8T (counted here: 2.780T)
    assert abs(f["active"] / 104e9 - 1) < 0.03  # and 104B active (counted here: 105.7B, DSA's indexer included)


def test_debug_model_packs_documents_exactly():
    c = ModelConfig.debug()
    m = build(c).eval()
    lens = [7, 12, 5]
    ids = torch.randint(0, 256, (1, sum(lens)), generator=torch.Generator().manual_seed(0))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = m(ids, doc_ids_BT=docs, positions_BT=pos)
        at = 0
        for n in lens:
            alone = m(ids[:, at : at + n])
            assert float((packed[:, at : at + n] - alone).norm() / alone.norm()) < 1e-10
            at += n


def test_images_attn_res_switch_and_a_training_step():
    c = ModelConfig.debug()
    m = build(c, dtype=torch.float32).train()
    ids = torch.randint(0, 256, (2, 40))
    ids[0, 3 : 3 + m.image_tokens] = IMAGE
    pixels = torch.randn(1, 3, 32, 32)
    logits = m(ids, pixels)
    assert logits.shape == (2, 40, 263) and torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 263), ids[:, 1:].reshape(-1))
    loss.backward()
    assert m.attn_res.weight.grad is not None and m.attn_res.weight.grad.abs().sum() > 0
    assert m.indexer_loss() is not None and float(m.indexer_loss().detach()) >= 0
    plain = build(ModelConfig(**{**ModelConfig.debug().__dict__, "attn_res": False}), dtype=torch.float32)
    assert plain.attn_res is None and torch.isfinite(plain(ids, pixels)).all()
    wrapped = apply_lora(
        build(c, dtype=torch.float32),
        LoraSpec(
            rank=2, target_modules=["q_proj", "o_proj", "q_b_proj"], target_parameters=["mlp.experts.gate_up_proj"]
        ),
    )
    assert any("layers.1.self_attn.q_b_proj" in w for w in wrapped) and any(w.endswith("mlp.experts") for w in wrapped)


def test_attention_kernels_get_bf16_under_autocast(monkeypatch):
    """Training runs an fp32 model (frozen base and LoRA factors) under bf16 autocast; the kernels
    must see bf16 activations, not fp32 ones: fp32 inputs take IEEE dot products, ~10x slower. (A
    LoRA layer after an RMSNorm returned fp32 and made the H200 step 760 ms instead of 117.)"""
    import engine.model.common.dsa as dsa
    import engine.model.common.kda as kimi_linear
    import engine.model.common.moe as moe

    seen: dict[str, list[torch.dtype]] = {}

    def spy(module, name, arity):
        inner = getattr(module, name)

        def call(*args, **kwargs):
            seen.setdefault(name, []).extend(a.dtype for a in args[:arity])
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    spy(kimi_linear, "kda_chunk", 3)  # q, k, v (the gate and beta stay fp32 on purpose)
    spy(kimi_linear, "short_conv", 1)  # q, k, v before their convolution
    spy(dsa, "sparse_attention", 3)  # q, k, v
    spy(moe, "grouped_mlp", 1)  # the experts' rows
    c = ModelConfig.debug(vocab_size=512)
    model = build(c, dtype=torch.float32)
    apply_lora(
        model,
        LoraSpec(
            rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj", "latent_down"]
        ),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 512, (1, 64)))
    assert set(seen) == {"kda_chunk", "short_conv", "sparse_attention", "grouped_mlp"}
    assert all(d == torch.bfloat16 for dts in seen.values() for d in dts), seen


def test_a_bf16_frozen_base_trains_as_the_fp32_one_under_autocast():
    """store_frozen keeps the frozen matmul weights (linear, conv, experts) in bf16: under bf16
    autocast the loss and every LoRA gradient are bit-equal to the fp32 base's (autocast gave the
    matmuls those very bf16 values), the weights take half the memory, and what autocast does not
    cast (norms, gates, the router, embeddings, the factors) stays fp32, and so does a weight a
    module reads as a matrix (DSA's absorbed kv_b_proj, with LoRA on it here)."""
    import copy

    from engine.lora import store_frozen

    c = ModelConfig.debug(vocab_size=512)
    base = build(c, dtype=torch.float32)
    apply_lora(
        base,
        LoraSpec(
            rank=4,
            target_modules=["q_proj", "o_proj", "latent_down", "down_proj", "kv_b_proj"],
            target_parameters=["mlp.experts.gate_up_proj"],
        ),
    )
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "lora_B" in n or n.endswith("_B"):
                p.normal_(0, 0.1)  # non-zero B: every LoRA factor gets a gradient
    small = copy.deepcopy(base)
    before = sum(p.numel() * p.element_size() for p in small.parameters())
    saved = store_frozen(small, torch.bfloat16)
    assert 0 < saved == before - sum(p.numel() * p.element_size() for p in small.parameters())
    dtypes = {n: p.dtype for n, p in small.named_parameters()}
    assert dtypes["layers.0.self_attn.q_proj.base.weight"] == dtypes["layers.1.mlp.experts.down_proj"] == torch.bfloat16
    assert dtypes["layers.0.self_attn.conv1d.weight"] == torch.bfloat16
    keep32 = [
        n
        for n in dtypes
        if "norm" in n or "lora" in n or "embed_tokens" in n or n.endswith("gate.weight") or "kv_b_proj" in n
    ]  # DSA reads kv_b_proj's weight as a matrix (MLA absorbed): left as it is
    assert keep32 and all(dtypes[n] == torch.float32 for n in keep32)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(3))
    got = {}
    for name, model in (("fp32", base), ("bf16", small)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        got[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert torch.equal(got["fp32"][0], got["bf16"][0])
    assert got["fp32"][1].keys() == got["bf16"][1].keys() and len(got["fp32"][1]) > 8
    for n, g in got["fp32"][1].items():
        assert g is not None and g.abs().sum() > 0, n
        assert torch.equal(g, got["bf16"][1][n]), n
