"""Gated DSA: parity with transformers' DeepSeek V3.2 attention, top-k >= length is dense
causal attention, documents stay apart, and the indexer learns from its KL loss only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.common.dsa import GatedDSAttention
from kiln_kernels.dsa import indexer_kl_loss, indexer_scores, indexer_topk, sparse_attention

DIMS = dict(
    hidden=64,
    heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope=16,
    qk_rope=8,
    v_dim=16,
    index_heads=3,
    index_head_dim=16,
)


def module(topk, gated=True, seed=0, dtype=torch.float64, **dims):
    torch.manual_seed(seed)
    m = GatedDSAttention(**{**DIMS, **dims}, index_topk=topk, gated=gated).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return m


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def test_parity_with_transformers_deepseek_v32_attention():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding

    cfg = transformers.DeepseekV32Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=5,
        vocab_size=100,
        num_hidden_layers=1,
        intermediate_size=64,
        moe_intermediate_size=32,
    )
    cfg._attn_implementation = "eager"
    theirs = DeepseekV32Attention(cfg, 0).eval()
    # 16 index heads: a key scores exactly 0 (all ReLUs off) with odds 2^-16, so no ties, whose
    # order transformers' topk and our stable sort settle differently
    ours = module(topk=5, gated=False, dtype=torch.float32, index_heads=16).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected
    B, T = 2, 23
    x = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(T)[None].expand(B, T)
    cos_sin = DeepseekV32RotaryEmbedding(cfg)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        want, _ = theirs(x, cos_sin, mask)
        got = ours(x, pos)
    assert rel(got, want) < 1e-4, rel(got, want)


def test_topk_at_least_the_length_is_dense_causal_attention():
    m = module(topk=40, gated=False).eval()
    x = torch.randn(2, 40, 64, dtype=torch.float64)
    with torch.no_grad():
        got = m(x)
        assert torch.isfinite(got).all()
        sparse = module(topk=5, gated=False).eval()(x)
    assert rel(got, sparse) > 1e-3  # a small top-k really drops keys
    # top-k = T selects every allowed key: the same as plain causal attention over all of them
    with torch.no_grad():
        m.indexer.weights_proj.weight.zero_()  # every score ties at 0: the selection cannot matter
        assert rel(m(x), got) < 1e-12


def test_topk_and_scores_respect_the_mask():
    B, T, J, D = 1, 12, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(B, T, J, D, generator=g), torch.randn(B, T, D, generator=g), torch.rand(B, T, J, generator=g)
    starts = torch.tensor([[0] * 5 + [5] * 7])  # two documents
    allowed = (torch.ones(T, T, dtype=torch.bool).tril() & (starts[0, :, None] <= torch.arange(T)))[None]
    s = indexer_scores(q, k, w, starts)
    assert torch.isinf(s[0][~allowed[0]]).all() and torch.isfinite(s[0][allowed[0]]).all()
    idx = indexer_topk(q, k, w, starts, 4)
    count = torch.tensor([1, 2, 3, 4, 4, 1, 2, 3, 4, 4, 4, 4])
    assert idx.shape == (1, T, 4) and ((idx >= 0).sum(-1)[0] == count).all()
    for t in range(T):
        chosen = idx[0, t, : count[t]]
        assert (chosen.diff() < 0).all() and ((idx[0, t, count[t] :]) == -1).all()  # descending, then -1
        assert allowed[0, t, chosen].all()
        assert s[0, t, chosen].min() >= s[0, t][allowed[0, t]].topk(int(count[t])).values.min()  # the best ones
    want = (w[..., None] * F.relu(torch.einsum("btjd,bsd->btjs", q, k) * D**-0.5)).sum(2)
    assert torch.allclose(s[0][allowed[0]], want[0][allowed[0]])


def test_ties_go_to_the_earlier_key():
    q, k = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 8)
    w = torch.zeros(1, 9, 2)  # every score 0
    idx = indexer_topk(q, k, w, torch.zeros(1, 9, dtype=torch.long), 3)
    assert idx[0, 8].tolist() == [2, 1, 0] and idx[0, 1].tolist() == [1, 0, -1]


def test_grouped_keys_are_the_same_as_repeated_heads():
    """G key heads shared by H / G query heads each equal H plain heads with repeated keys: the
    output, and the indexer's loss against the heads' averaged probabilities with its gradients."""
    g = torch.Generator().manual_seed(1)
    B, T, H, G, D, E = 2, 10, 6, 2, 8, 5
    q, k, v = (
        torch.randn(B, T, H, D, generator=g),
        torch.randn(B, T, G, D, generator=g),
        torch.randn(B, T, G, E, generator=g),
    )
    indexer = (
        torch.randn(B, T, 2, 4, generator=g),
        torch.randn(B, T, 4, generator=g),
        torch.randn(B, T, 2, generator=g),
    )
    idx = indexer_topk(*indexer, torch.zeros(B, T, dtype=torch.long), 4)

    def run(k, v):
        xs = [x.clone().requires_grad_() for x in indexer]
        o, loss = sparse_attention(q, k, v, idx, 0.3, indexer=xs)
        loss.backward()
        return o, loss, [x.grad for x in xs]

    o, loss, grads = run(k, v)
    full, loss_full, grads_full = run(k.repeat_interleave(3, 2), v.repeat_interleave(3, 2))
    assert rel(o, full) < 1e-6 and rel(loss, loss_full) < 1e-6 and float(loss.detach()) > 0
    assert all(rel(a, b) < 1e-6 for a, b in zip(grads, grads_full, strict=True))


def test_documents_stay_apart_and_the_gate_matters():
    m = module(topk=6)
    m.eval()
    x = torch.randn(1, 30, 64, dtype=torch.float64)
    docs = torch.tensor([[0] * 11 + [1] * 19])
    pos = torch.cat([torch.arange(11), torch.arange(19)])[None]
    with torch.no_grad():
        packed = m(x, pos, docs)
        first, second = m(x[:, :11]), m(x[:, 11:])
    assert rel(packed[:, :11], first) < 1e-12 and rel(packed[:, 11:], second) < 1e-12
    ungated = module(topk=6, gated=False).eval()
    with torch.no_grad():
        assert rel(ungated(x), m(x)) > 1e-2


def test_a_frozen_indexer_computes_no_target_or_loss():
    """LoRA that leaves the indexer out: its KL loss would have no gradient, so neither it nor the
    attention's target is computed; the attention's output is the same."""
    m = module(topk=4).train()
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    learning = m(x)
    assert m.last_indexer_loss is not None
    m.indexer.requires_grad_(False)
    assert torch.equal(m(x), learning) and m.last_indexer_loss is None


def test_indexer_learns_only_from_its_loss():
    m = module(topk=4).train()
    x = torch.randn(2, 16, 64, dtype=torch.float64, requires_grad=True)
    out = m(x)
    out.sum().backward(retain_graph=True)
    assert all(p.grad is None for p in m.indexer.parameters())  # the main loss does not reach it
    loss = m.last_indexer_loss
    assert loss is not None and float(loss.detach()) >= 0
    x.grad = None
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.indexer.parameters())
    assert x.grad is None or float(x.grad.abs().sum()) == 0.0  # and it does not reach the model
    # zero where the target is the indexer's own softmax
    q, k, w = (
        torch.randn(1, 5, 2, 4, dtype=torch.float64),
        torch.randn(1, 5, 4, dtype=torch.float64),
        torch.rand(1, 5, 2, dtype=torch.float64),
    )
    starts = torch.zeros(1, 5, dtype=torch.long)
    idx = indexer_topk(q, k, w, starts, 3)
    s = indexer_scores(q, k, w, starts).gather(-1, idx.clamp_min(0).long()).masked_fill(idx < 0, float("-inf"))
    assert float(indexer_kl_loss(q, k, w, idx, torch.softmax(s, -1))) < 1e-12


def test_deepseek_v32_checkpoint_logits_match_transformers(tmp_path):
    """A small random DeepSeek V3.2 saved by transformers (grouped routing, a dense first layer,
    shared experts), loaded through our loader into the hybrid model: the same logits."""
    transformers = pytest.importorskip("transformers")
    from engine.model.deepseek_v32 import load_deepseek_v32

    cfg = transformers.DeepseekV32Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=6,
        vocab_size=200,
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    ref = transformers.DeepseekV32ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in n else 0.1) + (1.0 if "norm" in n else 0.0))
        for layer in ref.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    ref.save_pretrained(tmp_path, max_shard_size="60KB")
    ours = load_deepseek_v32(tmp_path).eval()
    ids = torch.randint(0, 200, (2, 29), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids)
    assert rel(got, want) < 1e-4, rel(got, want)


def test_absorbed_form_equals_per_head_attention_with_lora():
    """The absorbed (multi-query) attention computes what per-head keys and values compute,
    LoRA on kv_b_proj included (its factors get the same gradients); with LoRA dropout the block
    runs per head."""
    from engine.lora import apply_lora
    from kiln.spec import LoraSpec

    m = module(topk=6).train()
    apply_lora(m, LoraSpec(rank=4, alpha=8, target_modules=["kv_b_proj", "q_b_proj"]))
    with torch.no_grad():
        m.kv_b_proj.lora_B.weight.normal_()  # a trained adapter, not the zero start
        m.q_b_proj.lora_B.weight.normal_()
    x = torch.randn(2, 19, 64, dtype=torch.float64)
    dy = torch.randn(2, 19, 64, dtype=torch.float64)

    def run():
        m.zero_grad()
        out = m(x)
        (out * dy).sum().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters() if p.requires_grad]

    absorbed, grads = run()
    m._absorbed = lambda: (None, None)  # force the per-head form
    per_head, grads_ph = run()
    assert rel(absorbed, per_head) < 1e-12
    assert all(rel(a, b) < 1e-10 for a, b in zip(grads, grads_ph, strict=True))
    del m._absorbed
    m.kv_b_proj.dropout = torch.nn.Dropout(0.1)
    assert m._absorbed() == (None, None)
    m.eval()
    assert m._absorbed()[0] is not None  # no dropout at evaluation
