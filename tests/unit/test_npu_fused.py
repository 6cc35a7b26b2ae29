"""The Ascend variants through torch_npu's fused operators (kiln_kernels/attention/npu.py:
``npu_fusion_attention``; kiln_kernels/moe/npu.py: ``npu_grouped_matmul``), against a stand-in
``torch_npu``.

**The operators themselves never ran**: this machine has no NPU and no CANN. The stand-in below
implements each operator's documented contract (torch_npu's API reference; the modules'
docstrings say where from) in plain PyTorch on CPU tensors, and asserts that the arguments it gets
are as the docs ask: the layout string, sparse_mode and its 2048 x 2048 bool mask, the documents'
cumulative ends as Python lists of ints, head_num, scale, one head dim for q, k and v; the group
list as a cumulative int64 tensor, group_type / split_item / group_list_type, the weights' [E, K, N]
layout. What passes here is our side of the contract (layouts, lengths, padding, slicing, the
grouped GEMMs' backward); whether CANN computes what its docs say, at what speed, is for an NPU.
Compared with each op's reference in float64, forward and every gradient, on fresh random inputs
(several documents of different lengths, experts with different row counts): fp32 < 1e-5.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln_kernels.attention import reference as attention_reference
from kiln_kernels.moe import reference as moe_reference

TOL = 1e-5  # fp32 against float64 (shared/ARCHITECTURE.md)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert not a.isnan().any()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- the stand-in torch_npu: the documented contracts in plain PyTorch ----------------------------


def _ends(name: str, ends: Any, total: int) -> list[int]:
    """A TND length argument: a host list of Python ints, cumulative ends rising to ``total``."""
    assert isinstance(ends, list) and all(type(e) is int for e in ends), (name, ends)
    assert ends and ends[-1] == total and all(b >= a for a, b in zip([0, *ends], ends, strict=False)), (name, ends)
    return ends


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
):
    """FlashAttentionScore, TND, sparse_mode 3 (rightDownCausal): per document, query i sees
    keys j <= i + Skv - Sq; differentiable (torch_npu's autograd gives the backward)."""
    CALLS.append(("npu_fusion_attention", {"D": query.shape[-1], "qlen": actual_seq_qlen, "kvlen": actual_seq_kvlen}))
    assert input_layout == "TND" and sparse_mode == 3 and keep_prob == 1.0
    assert pse is None and padding_mask is None and prefix is None
    assert isinstance(head_num, int) and head_num == query.shape[1] == key.shape[1] == value.shape[1]
    assert isinstance(scale, float)
    assert query.dim() == key.dim() == value.dim() == 3
    assert query.shape[-1] == key.shape[-1] == value.shape[-1]  # one head dim (FlashAttentionScore)
    assert query.dtype == key.dtype == value.dtype
    assert isinstance(atten_mask, torch.Tensor) and atten_mask.dtype == torch.bool
    assert atten_mask.shape == (2048, 2048) and atten_mask.device == query.device
    assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))  # True: masked
    qe = _ends("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    ke = _ends("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    assert len(qe) == len(ke)
    outs = []
    for q0, q1, k0, k1 in zip([0, *qe], qe, [0, *ke], ke, strict=False):
        Lq, Lk = q1 - q0, k1 - k0
        assert Lq <= Lk  # (sparse_mode 3 with Sq > Skv has whole masked rows)
        s = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), key[k0:k1].float()) * scale
        seen = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khe->qhe", p, value[k0:k1].float()).to(query.dtype))
    out = torch.cat(outs)
    stat = torch.zeros(query.shape[0], head_num, 8)
    return out, stat, stat, torch.zeros(0), 0, 0, 0


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=-1,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
):
    """GroupedMatmul, one packed x and one [E, K, N] weight: group_type 0 (groups along M,
    split_item 2: y [M, N]) or 2 (groups along K, split_item 3: y [E, N, K'])."""
    assert isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1
    assert bias is None and scale is None and offset is None and act_type == 0 and output_dtype is None
    assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1
    assert group_list_type == 0  # cumulative ends
    ends = group_list.tolist()
    assert all(b >= a for a, b in zip([0, *ends], ends, strict=False)), ends
    (a,), (w,) = x, weight
    assert a.dtype == w.dtype and a.dim() == 2
    cuts = list(zip([0, *ends], ends, strict=False))
    CALLS.append(("npu_grouped_matmul", {"group_type": group_type, "split_item": split_item}))
    if group_type == 0:  # y rows of group e = x rows of group e @ weight[e]
        assert split_item == 2 and w.dim() == 3 and w.shape[0] == len(ends) and w.shape[1] == a.shape[1]
        assert ends[-1] == a.shape[0]
        return [torch.cat([a[s:e] @ w[g] for g, (s, e) in enumerate(cuts)])]
    assert group_type == 2 and split_item == 3  # y[e] = x[:, group e] @ weight[group e]
    assert w.dim() == 2 and a.shape[1] == w.shape[0] == ends[-1]
    return [torch.stack([a[:, s:e] @ w[s:e] for s, e in cuts])]


CALLS: list[tuple[str, dict]] = []


@pytest.fixture
def npu(monkeypatch):
    """The stand-in in sys.modules as ``torch_npu``, then our modules (they import it lazily)."""
    module = types.ModuleType("torch_npu")
    module.__dict__.update(npu_fusion_attention=npu_fusion_attention, npu_grouped_matmul=npu_grouped_matmul)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    CALLS.clear()
    from kiln_kernels.attention import npu as attention
    from kiln_kernels.moe import npu as moe

    return types.SimpleNamespace(attention=attention, moe=moe)


# ---- full attention ---------------------------------------------------------------------------------


def _attention_case(cu_q: list[int], cu_k: list[int], H: int, D: int, E: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cu_q[-1], H, D, generator=g)
    k = torch.randn(cu_k[-1], H, D, generator=g)
    v = torch.randn(cu_k[-1], H, E, generator=g)
    do = torch.randn(cu_q[-1], H, E, generator=g)
    return q, k, v, do


@pytest.mark.parametrize(
    "cu_q, cu_k, D, E",
    [
        ([0, 5, 17, 17, 40], None, 192, 128),  # MLA's head dims, an empty document, plain causal
        ([0, 3, 3, 10, 10, 18], [0, 7, 7, 17, 23, 31], 24, 16),  # fewer queries than keys; keys, no queries
        ([0, 9, 20], None, 16, 16),  # one head dim: nothing padded
        ([0, 4, 11], [0, 4, 11], 16, 24),  # v wider than q/k: q and k padded
    ],
)
def test_fusion_attention_matches_the_reference(npu, cu_q, cu_k, D, E):
    q, k, v, do = _attention_case(cu_q, cu_k or cu_q, H=3, D=D, E=E, seed=len(cu_q) + D)
    cq = torch.tensor(cu_q)
    ck = None if cu_k is None else torch.tensor(cu_k)
    scale = 0.3 if D == 24 else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = npu.attention.varlen_attention(*leaves, cq, ck, scale)
    out.backward(do)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference.varlen_attention(*ref_leaves, cq, ck, scale)
    ref.backward(do.double())
    assert out.dtype == q.dtype and out.shape == (q.shape[0], 3, E)
    assert rel(out, ref) < TOL
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad is not None and want.grad is not None
        assert rel(got.grad, want.grad) < TOL
    (name, seen), *rest = CALLS
    assert name == "npu_fusion_attention" and not rest
    assert seen["D"] == max(D, E)  # padded to one head dim
    keep = [
        (q1, k1)
        for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k or cu_q, (cu_k or cu_q)[1:], strict=False)
        if q1 > q0 or k1 > k0
    ]
    assert seen["qlen"] == [e for e, _ in keep] and seen["kvlen"] == [e for _, e in keep]  # cumulative ends


def test_fusion_attention_no_queries(npu):
    q, k, v = torch.randn(0, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 4)
    out = npu.attention.varlen_attention(q, k, v, torch.tensor([0, 0]))
    assert out.shape == (0, 2, 4) and not CALLS


def test_the_mask_is_made_once_per_device(npu):
    m = npu.attention.causal_mask(torch.device("cpu"))
    assert m is npu.attention.causal_mask(torch.device("cpu"))
    assert m.dtype == torch.bool and m.shape == (2048, 2048) and m[0, 1] and not m[1, 0] and not m[5, 5]


# ---- the experts' grouped MLP ---------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("train_experts", [False, True])
def test_grouped_matmul_mlp_matches_the_reference(npu, with_lora, train_experts):
    g = torch.Generator().manual_seed(7 + 2 * with_lora + train_experts)
    E, D, I, r = 5, 16, 12, 4
    counts = torch.tensor([3, 0, 7, 1, 9])  # an expert no row chose
    M = int(counts.sum())
    x = torch.randn(M, D, generator=g)
    w = torch.rand(M, generator=g)  # the rows' routing weights: the experts weigh their rows
    W1 = torch.randn(E, 2 * I, D, generator=g) * 0.3
    W2 = torch.randn(E, D, I, generator=g) * 0.3
    dy = torch.randn(M, D, generator=g)
    lora = {
        "gate_up_proj": (torch.randn(E, r, D, generator=g) * 0.3, torch.randn(E, 2 * I, r, generator=g) * 0.3),
        "down_proj": (torch.randn(E, r, I, generator=g) * 0.3, torch.randn(E, D, r, generator=g) * 0.3),
    }

    def leaves(dtype):
        out = {"x": x.to(dtype, copy=True).requires_grad_(), "w": w.to(dtype, copy=True).requires_grad_()}
        out["W1"], out["W2"] = (W.to(dtype, copy=True).requires_grad_(train_experts) for W in (W1, W2))
        if with_lora:
            for name, (A, B) in lora.items():
                out[name + ".A"], out[name + ".B"] = (
                    A.to(dtype, copy=True).requires_grad_(),
                    B.to(dtype, copy=True).requires_grad_(),
                )
        return out

    def run(fn, t):
        lo = {n: (t[n + ".A"], t[n + ".B"]) for n in lora} if with_lora else None
        return fn(t["x"], counts, t["W1"], t["W2"], swiglu, lo, 0.5, t["w"])

    got, want = leaves(torch.float32), leaves(torch.float64)
    y = run(npu.moe.grouped_mlp, got)
    y.backward(dy)
    y_ref = run(moe_reference.grouped_mlp, want)
    y_ref.backward(dy.double())
    assert y.dtype == torch.float32 and y.shape == (M, D)
    assert rel(y, y_ref) < TOL
    for name, t in got.items():
        if t.requires_grad:
            assert t.grad is not None, name
            assert rel(t.grad, want[name].grad) < TOL, name
        else:
            assert t.grad is None, name
    kinds = [(c["group_type"], c["split_item"]) for _, c in CALLS]
    assert all(name == "npu_grouped_matmul" for name, _ in CALLS)
    # weight gradients (group_type 2) only for what trains: the experts, or the LoRA factors
    assert ((2, 3) in kinds) == (train_experts or with_lora)
    assert set(kinds) <= {(0, 2), (2, 3)}


def test_grouped_matmul_usable_only_on_an_npu(npu):
    x, W = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert not npu.moe.usable(x, W, W, None)
    like_npu = types.SimpleNamespace(device=torch.device("meta"), dtype=torch.bfloat16)
    like_npu.device = types.SimpleNamespace(type="npu")
    assert npu.moe.usable(like_npu, W, W, None)
    like_npu.dtype = torch.float64
    assert not npu.moe.usable(like_npu, W, W, None)
