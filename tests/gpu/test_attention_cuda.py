"""Causal attention over packed documents on CUDA (kiln_kernels/attention/flash.py) against the
float64 definition on fresh random inputs: the output and the gradients of q, k and v, for both
backends (flash with the narrower head dim padded; memory-efficient; SDPA for equal documents,
flash for the rest), bf16 and fp32, MLA's head
dims (q/k 192, v 128) and plain ones, packed rows with empty and one-token documents, documents
whose queries are their last keys (context parallel), long documents; the dispatch; and
Kimi Linear's packed rows against each document alone on the GPU."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.attention import reference, varlen_attention
from tests.tolerance import rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CASES = [
    ([0, 5, 5, 6, 300, 301, 700], None),
    ([0, 1], None),
    ([0, 0, 129, 129, 1000], None),
    ([0, 3, 200, 201], [0, 100, 400, 640]),
    ([0, 4096], None),
    ([0, 1000, 2500], [0, 3000, 6000]),
    ([0, 512, 1024, 1536], None),  # equal documents: SDPA's batch (cuDNN) under the sdpa backend
]


def inputs(T, S, H, D, E, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = torch.randn(T, H, D, device="cuda", generator=g), torch.randn(S, H, D, device="cuda", generator=g)
    v, do = torch.randn(S, H, E, device="cuda", generator=g), torch.randn(T, H, E, device="cuda", generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [do.to(dtype)]


@pytest.mark.parametrize(
    "backend,dtype",
    [("flash", torch.bfloat16), ("efficient", torch.bfloat16), ("efficient", torch.float32), ("sdpa", torch.bfloat16)],
)
@pytest.mark.parametrize("cu_q,cu_k", CASES)
@pytest.mark.parametrize("H,D,E", [(4, 192, 128), (3, 64, 64)])
def test_matches_the_definition(backend, dtype, cu_q, cu_k, H, D, E):
    from kiln_kernels.attention import flash

    cq = torch.tensor(cu_q)
    ck = torch.tensor(cu_k) if cu_k else None
    q, k, v, do = inputs(cu_q[-1], (cu_k or cu_q)[-1], H, D, E, dtype, cu_q[-1] + D)
    o = flash.varlen_attention(q, k, v, cq, ck, scale=D**-0.5, backend=backend)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference.varlen_attention(q64, k64, v64, cq, ck, scale=D**-0.5)
    want.backward(do.double())
    assert o.shape == (cu_q[-1], H, E) and o.dtype == dtype
    assert rel(o, want) < TOL[dtype]
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        if not ref.any():  # a one-token document: its key's gradient is exactly 0 (a softmax of one score)
            assert got.norm() < TOL[dtype] * do.float().norm()  # rounding only
            continue
        assert got.shape == ref.shape and rel(got, ref) < TOL[dtype]


def test_the_dispatch_runs_the_kernels_on_cuda_without_a_mask(monkeypatch):
    """No [T, T] tensor: 64k tokens in one document take far less than the mask's 4 GiB."""
    q, k, v, do = inputs(65536, 65536, 2, 64, 64, torch.bfloat16, 3)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = varlen_attention(q, k, v, torch.tensor([0, 65536]))
    o.backward(do)
    assert torch.cuda.max_memory_allocated() - base < 2**30


def test_kimi_linear_packed_rows_equal_each_document_alone():
    from engine.model.kimi_linear import KimiLinearForCausalLM, init_kimi_linear, kimi_linear_tiny_config

    model = KimiLinearForCausalLM(kimi_linear_tiny_config())
    init_kimi_linear(model, 0)
    model = model.cuda()
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 250, (n,), generator=g) for n in (70, 1, 130)]
    ids = torch.cat(docs)[None].cuda()
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None].cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(ids, None, doc_ids, None)
        alone = torch.cat([model(d[None].cuda()) for d in docs], 1)
    assert rel(packed.float(), alone.float()) < 2e-2
