"""Causal attention over packed documents (kiln_kernels.attention) on the CPU: the per-document
form the CPU trains with against the masked definition (float64), forward and the gradients of
q, k and v, fp32 and bf16, with empty and one-token documents and documents whose queries are
only the last of their keys (context parallel); the mask itself against a token-by-token rule;
and the models' packed rows against each document alone."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.attention import reference, varlen_attention
from tests.tolerance import rel

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(T: int, S: int, H: int, D: int, E: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, D, generator=g), torch.randn(S, H, D, generator=g)
    v, do = torch.randn(S, H, E, generator=g), torch.randn(T, H, E, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [do.to(dtype)]


CASES = [  # (query offsets, key offsets): empty documents, one-token ones, fewer queries than keys
    ([0, 5, 5, 6, 40, 41, 64], None),
    ([0, 1], None),
    ([0, 37], None),
    ([0, 0, 12, 12, 30], None),
    ([0, 3, 20, 21], [0, 10, 27, 40]),  # each document's queries are its last keys
    ([0, 0, 16], [0, 9, 40]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cu_q,cu_k", CASES)
@pytest.mark.parametrize("D,E", [(24, 16), (16, 16)])
def test_per_document_matches_the_definition(cu_q, cu_k, D, E, dtype):
    cq = torch.tensor(cu_q)
    ck = torch.tensor(cu_k) if cu_k else None
    q, k, v, do = inputs(cu_q[-1], (cu_k or cu_q)[-1], 3, D, E, dtype, sum(cu_q) + D)
    o = varlen_attention(q, k, v, cq, ck, scale=0.3)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference.varlen_attention(q64, k64, v64, cq, ck, scale=0.3)
    want.backward(do.double())
    assert o.shape == (cu_q[-1], 3, E) and o.dtype == dtype
    assert rel(o, want) < TOL[dtype]
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        if not ref.any():  # a one-token document: its key's gradient is exactly 0 (a softmax of one score)
            assert got.norm() < TOL[dtype] * do.float().norm()  # rounding only
            continue
        assert rel(got, ref) < TOL[dtype]


def test_the_mask_is_causal_inside_each_document_aligned_to_its_last_keys():
    cu_q, cu_k = [0, 2, 2, 5], [0, 4, 6, 9]
    mask = reference.document_mask(torch.tensor(cu_q), torch.tensor(cu_k))
    want = torch.zeros(5, 9, dtype=torch.bool)
    for n in range(3):
        Lq, Lk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        for i in range(Lq):
            for j in range(Lk):
                want[cu_q[n] + i, cu_k[n] + j] = j <= i + Lk - Lq
    assert torch.equal(mask, want)


def test_a_change_in_one_document_moves_nothing_in_another():
    cu = torch.tensor([0, 10, 11, 30])
    q, k, v, _ = inputs(30, 30, 2, 8, 8, torch.float32, 1)
    before = varlen_attention(q, k, v, cu)
    k2 = k.detach().clone()
    k2[12:] += 1.0  # the last document's keys
    after = varlen_attention(q, k2, v, cu)
    assert torch.equal(before[:11], after[:11]) and not torch.allclose(before[11:], after[11:])


@pytest.mark.parametrize(
    "cu_q,cu_k,why",
    [
        ([0, 4, 3], None, "document 1: -1 queries"),
        ([0, 2, 5], [0, 5], "as many each"),
        ([0, 3, 6], [0, 2, 6], "document 0: 3 queries and 2 keys"),
    ],
)
def test_bad_offsets_are_an_error(cu_q, cu_k, why):
    T, S = cu_q[-1], (cu_k or cu_q)[-1]
    q, k, v, _ = inputs(T, max(S, 1), 1, 4, 4, torch.float32, 0)
    k, v = k[:S], v[:S]
    with pytest.raises(ValueError, match=why):
        varlen_attention(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k) if cu_k else None)
