"""The Triton DSA kernels against the float64 reference on fresh random inputs: the top-k
selection, the sparse attention (output, indexer target, every gradient), the indexer's KL loss
(value and every gradient); multi-query (MLA absorbed), grouped and per-head keys, packed
documents, ragged counts; fp32 and bf16 (ARCHITECTURE.md's tolerances). On a CPU these run
through Triton's interpreter at the small shapes (tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln_kernels.dsa import reference as R
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]

# B, T, J, DH, topk, packed documents
INDEX = [
    (1, 37, 3, 16, 8, False),
    (2, 90, 8, 32, 16, True),
    pytest.param(1, 2100, 64, 128, 2048, False, marks=gpu_only),
    pytest.param(2, 1300, 16, 64, 512, True, marks=gpu_only),
]
# B, T, H, G, D, E, topk, packed documents
ATTN = [
    (1, 37, 4, 1, 24, 16, 8, False),
    (2, 46, 4, 4, 24, 16, 8, True),
    (1, 50, 32, 2, 80, 64, 64, False),
    (1, 30, 48, 1, 24, 16, 8, True),  # heads in two blocks, the second part padding
    pytest.param(1, 1500, 16, 1, 576, 512, 512, False, marks=gpu_only),
    pytest.param(2, 700, 8, 8, 192, 128, 256, True, marks=gpu_only),
    pytest.param(1, 300, 128, 1, 576, 512, 2048, False, marks=gpu_only),
    pytest.param(2, 333, 128, 2, 576, 512, 200, True, marks=gpu_only),  # bf16, shared: Hopper's Gluon walk
    pytest.param(1, 700, 64, 1, 576, 512, 256, True, marks=gpu_only),  # ... and forward: the model's one head block
]


def starts(B: int, T: int, packed: bool) -> torch.Tensor:
    s = torch.zeros(B, T, dtype=torch.long, device=DEVICE)
    if packed:  # three documents of uneven lengths
        s[:, T // 5 :] = T // 5
        s[:, T // 2 + 3 :] = T // 2 + 3
    return s


def indexer_inputs(B, T, J, DH, dtype, seed, exact_dots=False):
    """Random index queries, keys and weights. ``exact_dots``: q and k on a grid of quarters, so
    that every q . k is exact in fp32 and bf16 and the ReLU switches at the same place in the
    kernel and in the float64 reference (a dot within rounding of 0 would otherwise switch one
    term of a gradient on or off, an error of the function, not of the kernel)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, T, J, DH, device=DEVICE, generator=g)
    k = torch.randn(B, T, DH, device=DEVICE, generator=g)
    if exact_dots:
        q, k = (q * 4).round().clamp(-8, 8) / 4, (k * 4).round().clamp(-8, 8) / 4
    q, k = q.to(dtype), k.to(dtype)
    w = (torch.randn(B, T, J, device=DEVICE, generator=g) * J**-0.5).to(dtype)
    return q, k, w


@pytest.fixture(params=["rows", "bound"])
def kth_from(request, monkeypatch):
    """The top-k's k-th best key found in whole rows, or (``bound``) among the keys above the
    groups' bound (``_kth``), taken here at lengths where its cost rule would not take it; the
    test fails where the path named is not the one that ran."""
    from kiln_kernels.dsa import triton as K

    GS = 2
    params = request.node.callspec.params
    if request.param == "bound" and params.get("S", params.get("T", 0)) < GS * params.get("topk", 0):
        pytest.skip(f"fewer groups of {GS} keys than k: no bound")
    monkeypatch.setitem(K.CONFIG, "topk", dict(GS=GS, share=2.0 if request.param == "bound" else 0.0))
    used, kth = [], K._kth

    def spy(keys, maxes, *args):
        used.append(maxes is not None)
        return kth(keys, maxes, *args)

    monkeypatch.setattr(K, "_kth", spy)
    yield
    assert used and all(used) == (request.param == "bound")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,J,DH,topk,packed", INDEX)
def test_topk_selects_the_best_keys(B, T, J, DH, topk, packed, dtype, kth_from):
    from kiln_kernels.dsa.triton import indexer_topk

    q, k, w = indexer_inputs(B, T, J, DH, dtype, seed=T)
    st = starts(B, T, packed)
    idx = indexer_topk(q, k, w, st, topk)
    scores = R.indexer_scores(q.double(), k.double(), w.double(), st)
    allowed = R.allowed_keys(st, T)
    count = allowed.sum(-1).clamp_max(topk)
    assert idx.shape == (B, T, min(topk, T)) and idx.dtype == torch.int32
    assert ((idx >= 0).sum(-1) == count).all()  # as many as allowed, up to k
    valid = idx >= 0
    assert (valid[..., :-1] | ~valid[..., 1:]).all()  # valid entries first
    pos = idx.clamp_min(0).long()
    assert torch.gather(allowed, -1, pos)[valid].all()
    chosen = torch.gather(scores, -1, pos).masked_fill(~valid, float("inf")).min(-1).values
    kth = scores.topk(min(topk, T), -1).values.gather(-1, (count - 1)[..., None])[..., 0]
    slack = 1e-5 * scores[allowed].abs().max()  # fp32 sums in another order: only near-ties may swap
    assert (chosen >= kth - slack).all()
    want = R.indexer_topk(q.double(), k.double(), w.double(), st, topk)
    assert (idx == want).float().mean() > 0.99


@pytest.mark.parametrize(
    "S,T,topk,packed", [(90, 37, 8, True), (64, 64, 16, False), pytest.param(3000, 1000, 512, True, marks=gpu_only)]
)
def test_topk_of_the_last_queries_against_earlier_keys(S, T, topk, packed, kth_from):
    """Context parallel's form: queries that are the last T of S keys choose what the same
    queries choose when every key's query is there too (their starts as they were)."""
    from kiln_kernels.dsa.triton import indexer_topk

    q, k, w = indexer_inputs(1, S, 4, 16, torch.float32, seed=S, exact_dots=True)
    st = starts(1, S, packed)
    whole = indexer_topk(q, k, w, st, topk)
    last = indexer_topk(q[:, -T:], k, w[:, -T:], st[:, -T:], topk)
    assert torch.equal(last, whole[:, -T:])
    want = R.indexer_topk(q[:, -T:].double(), k.double(), w[:, -T:].double(), st[:, -T:], topk)
    assert want.shape == last.shape and (last == want).float().mean() > 0.99  # fp32 sums: only near-ties may swap


@pytest.mark.parametrize("packed", [False, True])
def test_topk_ties_go_to_the_earlier_key(packed, kth_from):
    """Scores on a coarse grid, exact in fp32 summed in any order: many keys tie (at 0 and above
    it), and the kernel chooses exactly what the reference chooses, the earlier key of a tie."""
    from kiln_kernels.dsa.triton import indexer_topk

    g = torch.Generator(device=DEVICE).manual_seed(3)
    B, T, J, DH = 1, 300, 4, 16
    q = torch.randint(-1, 2, (B, T, J, DH), generator=g, device=DEVICE).float()
    k = torch.randint(-1, 2, (B, T, DH), generator=g, device=DEVICE).float()
    w = torch.randint(-2, 3, (B, T, J), generator=g, device=DEVICE).float() / 4
    st = starts(B, T, packed)
    want = R.indexer_topk(q.double(), k.double(), w.double(), st, 40)
    scores = R.indexer_scores(q.double(), k.double(), w.double(), st)[0, -1]
    assert scores[torch.isfinite(scores)].unique().numel() < 100  # ties: 300 keys on under 100 values
    assert torch.equal(indexer_topk(q, k, w, st, 40), want)


@gpu_only
def test_topk_at_a_length_whose_scores_would_not_fit_the_device():
    """T queries whose [T, T] fp32 scores alone would take more than the device's memory: the
    top-k still runs, and sampled queries (the first, the last, some between) choose what the
    float64 reference chooses for that query alone (its scores one [1, t + 1] row)."""
    from kiln_kernels.dsa.triton import indexer_topk

    total = torch.cuda.get_device_properties(DEVICE).total_memory
    T = (int((total / 4) ** 0.5) // 4096 + 1) * 4096  # T * T * 4 bytes > the device's memory
    q, k, w = indexer_inputs(1, T, 8, 32, torch.bfloat16, seed=7)
    st = torch.zeros(1, T, dtype=torch.long, device=DEVICE)
    idx = indexer_topk(q, k, w, st, 2048)
    assert idx.shape == (1, T, 2048)
    for t in [0, 1, 2047, 2048, T // 3, T // 2 + 5, T - 2, T - 1]:
        want = R.indexer_topk(
            q[:, t : t + 1].double(), k[:, : t + 1].double(), w[:, t : t + 1].double(), st[:, :1], 2048
        )
        got = idx[:, t : t + 1, : want.shape[-1]]
        assert (idx[:, t, want.shape[-1] :] == -1).all()
        assert (got == want).float().mean() > 0.99, t  # fp32 sums in another order: only near-ties may swap


def attention_against_the_reference(q, k, v, idx, indexer, do, dtype, loss_grad=0.7):
    """The kernels' attention with the indexer's loss against the float64 reference's (``v``
    None: the values are a view of the keys' first E dims): the output, the loss (NaN until the
    backward writes it) and every gradient, o's and the loss's backward at once."""
    from kiln_kernels.dsa import triton as K

    E = do.shape[-1]

    def run(module, xs, grads):
        q, k, *rest = xs
        values, ix = (k[..., :E], rest) if v is None else (rest[0], rest[1:])
        o, loss = module.sparse_attention(q, k, values, idx, q.shape[-1] ** -0.5, ix)
        if module is K:
            assert o.dtype == dtype and loss.dtype == torch.float32 and torch.isnan(loss)  # until the backward
        torch.autograd.backward([o, loss], grads)
        return o, loss

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, *([] if v is None else [v]), *indexer)]
    o, loss = run(K, leaves, [do, torch.tensor(loss_grad, device=DEVICE)])
    x64 = [x.detach().double().requires_grad_() for x in leaves]
    o64, loss64 = run(R, x64, [do.double(), torch.tensor(loss_grad, dtype=torch.float64, device=DEVICE)])
    tol = TOL[dtype]
    assert rel(o, o64) < tol and rel(loss, loss64) < tol and float(loss.detach()) > 0
    for got, want in zip(leaves, x64, strict=True):
        assert got.grad is not None and rel(got.grad, want.grad) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,G,D,E,topk,packed", ATTN)
def test_sparse_attention_matches_the_reference(B, T, H, G, D, E, topk, packed, dtype):
    """The output, the indexer's loss against the heads' averaged probabilities (its target,
    from the backward) and every gradient: q, k, v and the indexer's q, k, w."""
    from kiln_kernels.dsa.triton import indexer_topk

    indexer = indexer_inputs(B, T, 4, 16, dtype, seed=1, exact_dots=True)
    idx = indexer_topk(*indexer, starts(B, T, packed), topk)
    g = torch.Generator(device=DEVICE).manual_seed(D + T)
    q = torch.randn(B, T, H, D, device=DEVICE, generator=g).to(dtype)
    k = torch.randn(B, T, G, D, device=DEVICE, generator=g).to(dtype)
    v = torch.randn(B, T, G, E, device=DEVICE, generator=g).to(dtype)
    do = torch.randn(B, T, H, E, device=DEVICE, generator=g).to(dtype)
    attention_against_the_reference(q, k, v, idx, indexer, do, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,G,D,E,topk,packed", ATTN)
def test_values_that_are_the_keys_first_dims_match_the_reference(B, T, H, G, D, E, topk, packed, dtype):
    """MLA's absorbed form: the values are a view of the keys' first E dims (the latent is both),
    which the forward reads from the key tiles; the output, the indexer's loss and every gradient
    (the keys' through both) match the reference's; a copy of those dims is not taken for shared."""
    from kiln_kernels.dsa.triton import indexer_topk, shared_values

    indexer = indexer_inputs(B, T, 4, 16, dtype, seed=2, exact_dots=True)
    idx = indexer_topk(*indexer, starts(B, T, packed), topk)
    g = torch.Generator(device=DEVICE).manual_seed(D + T + 1)
    q = torch.randn(B, T, H, D, device=DEVICE, generator=g).to(dtype)
    kv = torch.randn(B, T, G, D, device=DEVICE, generator=g).to(dtype)
    do = torch.randn(B, T, H, E, device=DEVICE, generator=g).to(dtype)
    assert shared_values(kv, kv[..., :E]) and not shared_values(kv, kv[..., :E].contiguous())
    attention_against_the_reference(q, kv, None, idx, indexer, do, dtype)


@gpu_only
@pytest.mark.parametrize(
    "B,T,H,G,topk,packed",
    [(1, 300, 128, 1, 2048, False), (2, 333, 128, 2, 200, True), (1, 1100, 64, 1, 1000, False)],
)
def test_hopper_forward_matches_the_reference(B, T, H, G, topk, packed):
    """The Gluon forward (Hopper; the model's shape: the values the keys' first 512 of 576 dims,
    blocks of 64 heads): its output and its heads' log-sum-exps (base 2, which the backward
    reads) against the float64 reference's, with two head blocks, two key heads, packed
    documents, and counts that end inside a block of keys. The attention takes this path at the
    model's one block of 64 heads on one key head (``hopper.forward_checked``)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is Hopper's")
    import math

    from kiln_kernels.dsa import hopper
    from kiln_kernels.dsa import triton as K

    idx = K.indexer_topk(*indexer_inputs(B, T, 4, 16, torch.bfloat16, seed=3), starts(B, T, packed), topk)
    g = torch.Generator(device=DEVICE).manual_seed(T + H)
    q = torch.randn(B, T, H, 576, device=DEVICE, generator=g).to(torch.bfloat16)
    kv = torch.randn(B, T, G, 576, device=DEVICE, generator=g).to(torch.bfloat16)
    assert hopper.fits(q, kv, H // G, 512, 64)
    o = torch.empty(B, T, H, 512, dtype=q.dtype, device=DEVICE)
    lse = torch.empty(B, T, H, device=DEVICE)
    scale = 576**-0.5
    meta = dict(H=H, G=G, D=576, DA=512, DB=64)
    hopper.forward(q, kv, idx, K._counts(idx), o, lse, scale * math.log2(math.e), meta)
    q64, kv64 = q.double(), kv.double()
    assert rel(o, R.sparse_attention(q64, kv64, kv64[..., :512], idx, scale)) < TOL[torch.bfloat16]
    assert rel(lse, torch.logsumexp(R._head_scores(q64, kv64, idx, scale), -1) / math.log(2)) < 1e-3
    if hopper.forward_checked(H, G):  # the attention's forward is this one
        assert (K.sparse_attention(q, kv, kv[..., :512], idx, scale) == o).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37, 16), (2, 5, 100), (1, 9, 4, 512)])
def test_row_dots_are_fp32_sums_of_products(shape, dtype):
    """The backward's delta (the output gradient's dot with the output, a row each): rows and
    widths that fill no block, products summed in fp32 whatever the inputs' dtype."""
    from kiln_kernels.dsa.triton import _row_dots

    g = torch.Generator(device=DEVICE).manual_seed(29)
    a, b = (torch.randn(shape, device=DEVICE, generator=g).to(dtype) for _ in range(2))
    got = _row_dots(a, b)
    assert got.dtype == torch.float32 and got.shape == shape[:-1]
    assert rel(got, (a.double() * b.double()).sum(-1)) < 1e-6


@pytest.mark.parametrize("which", ["output", "loss"])
def test_a_backward_of_one_output_does_only_its_work(which):
    """Autograd sends None for an output the backward did not reach. The output's alone: the
    attention's gradients, no target, no loss (the indexer gets no gradient, the loss stays NaN).
    The loss's alone: the indexer's gradients as the reference's (the walk runs with a zero
    output gradient, for the target), the attention's zero."""
    from kiln_kernels.dsa.triton import indexer_topk, sparse_attention

    B, T, H, D, E = 1, 40, 4, 24, 16
    indexer = indexer_inputs(B, T, 4, 16, torch.float32, seed=6, exact_dots=True)
    idx = indexer_topk(*indexer, starts(B, T, True), 8)
    g = torch.Generator(device=DEVICE).manual_seed(17)
    q, k, v = (torch.randn(B, T, n, d, device=DEVICE, generator=g) for n, d in ((H, D), (1, D), (1, E)))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *indexer)]
    o, loss = sparse_attention(*leaves[:3], idx, D**-0.5, leaves[3:])
    x64 = [x.detach().double().requires_grad_() for x in leaves]
    o64, loss64 = R.sparse_attention(*x64[:3], idx, D**-0.5, x64[3:])
    if which == "output":
        do = torch.randn(B, T, H, E, device=DEVICE, generator=g)
        o.backward(do)
        o64.backward(do.double())
        assert torch.isnan(loss) and all(x.grad is None for x in leaves[3:])
        mine, theirs = leaves[:3], x64[:3]
    else:
        loss.backward()
        loss64.backward()
        assert rel(loss, loss64) < 1e-5 and all(float(x.grad.abs().sum()) == 0 for x in leaves[:3])
        mine, theirs = leaves[3:], x64[3:]
    for got, want in zip(mine, theirs, strict=True):
        assert rel(got.grad, want.grad) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,J,DH,topk,packed", INDEX)
def test_indexer_loss_matches_the_reference(B, T, J, DH, topk, packed, dtype):
    from kiln_kernels.dsa.triton import indexer_kl_loss, indexer_topk

    q, k, w = indexer_inputs(B, T, J, DH, dtype, seed=T + 1, exact_dots=True)
    st = starts(B, T, packed)
    idx = indexer_topk(q, k, w, st, topk)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    logits = torch.randn(B, T, idx.shape[-1], device=DEVICE, generator=g).masked_fill(idx < 0, float("-inf"))
    p = torch.softmax(logits, -1)  # a target on the selected keys
    for x in (q, k, w):
        x.requires_grad_()
    loss = indexer_kl_loss(q, k, w, idx, p)
    (loss * 0.7).backward()
    q64, k64, w64 = (x.detach().double().requires_grad_() for x in (q, k, w))
    want = R.indexer_kl_loss(q64, k64, w64, idx, p.double())
    (want * 0.7).backward()
    tol = TOL[dtype]
    assert loss.shape == () and rel(loss, want) < tol
    assert rel(q.grad, q64.grad) < tol and rel(k.grad, k64.grad) < tol and rel(w.grad, w64.grad) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(
    "B,T,H,G,D,E,topk",
    [
        (2, 28, 4, 2, 24, 16, 8),
        (1, 30, 48, 1, 24, 16, 8),
        pytest.param(1, 1500, 16, 1, 576, 512, 512, marks=gpu_only),
        pytest.param(1, 400, 128, 1, 576, 512, 256, marks=gpu_only),  # bf16, shared: Hopper's Gluon walk
    ],
)
def test_deterministic_backward_is_reproducible(B, T, H, G, D, E, topk, shared, dtype, monkeypatch):
    """Under torch.use_deterministic_algorithms the keys' gradients (attention and indexer loss) and
    the indexer's target (its head blocks' shares) are summed in a fixed order, in several chunks
    of queries here: two runs are bit-equal and as close
    to float64 as the atomic sums are (Swap Core's exactness on the GPU is checked this way).
    ``shared``: the values a view of the keys' first dims, their gradient in the keys' slots."""
    from kiln_kernels.dsa import triton as K

    monkeypatch.setattr(K, "ORDERED_BYTES", 4 * B * min(T, topk) * 16 * (T // 3))  # chunks: the loss's 3-4, more
    st = starts(B, T, True)
    iq, ik, iw = indexer_inputs(B, T, 4, 16, dtype, seed=T + 2, exact_dots=True)
    idx = K.indexer_topk(iq, ik, iw, st, topk)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (torch.randn(B, T, n, d, device=DEVICE, generator=g).to(dtype) for n, d in ((H, D), (G, D), (G, E)))
    do = torch.randn(B, T, H, E, device=DEVICE, generator=g).to(dtype)

    def grads():
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, iq, ik, iw)]
        values = xs[1][..., :E] if shared else xs[2]
        o, loss = K.sparse_attention(xs[0], xs[1], values, idx, D**-0.5, xs[3:])
        ((o.float() * do.float()).sum() + loss).backward()
        return [x.grad for x in xs if x.grad is not None]

    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v, iq, ik, iw)]
    values64 = x64[1][..., :E] if shared else x64[2]
    o64, loss64 = R.sparse_attention(x64[0], x64[1], values64, idx, D**-0.5, x64[3:])
    ((o64 * do.double()).sum() + loss64).backward()
    want = [x.grad for x in x64 if x.grad is not None]
    assert len(first) == len(want) == (5 if shared else 6)
    for got, w in zip(first, want, strict=True):
        assert rel(got, w) < TOL[dtype]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("B,T,H,G,D,E,topk", [(1, 37, 48, 1, 24, 16, 8), (2, 40, 32, 2, 24, 16, 8)])
def test_backward_in_chunks_of_queries_and_head_blocks_matches_the_reference(
    B, T, H, G, D, E, topk, shared, monkeypatch
):
    """The backward's walk writes its p and ds for a chunk of queries at a time (``WALK_BYTES``:
    here 4-6 chunks), each query's heads in several blocks (16 heads: 48 in three, the walk's
    columns padded to 64), whose shares of the indexer's target add up; the keys' products then
    take all of a query's heads. The output, the loss and every gradient match the reference's."""
    from kiln_kernels.dsa import triton as K

    for name in ("bwd", "bwd shared"):
        monkeypatch.setitem(K.CONFIG, name, {**K.CONFIG[name], "BH": 16})
    monkeypatch.setattr(K, "WALK_BYTES", 2 * B * G * topk * K._pow2(H // G) * 4 * (T // 5))
    indexer = indexer_inputs(B, T, 4, 16, torch.float32, seed=9, exact_dots=True)
    idx = K.indexer_topk(*indexer, starts(B, T, True), topk)
    g = torch.Generator(device=DEVICE).manual_seed(13)
    q, k, v = (torch.randn(B, T, n, d, device=DEVICE, generator=g) for n, d in ((H, D), (G, D), (G, E)))
    do = torch.randn(B, T, H, E, device=DEVICE, generator=g)
    attention_against_the_reference(q, k, None if shared else v, idx, indexer, do, torch.float32)


@pytest.mark.parametrize("alias", ["detached", "keys without a gradient"])
def test_values_aliasing_the_keys_apart_from_their_graph_get_their_own_gradient(alias):
    """Values that share the keys' memory but whose gradient does not flow through the keys' (a
    detached alias; a view of keys that need none): the forward may read them from the key
    tiles, the backward gives each its own gradient."""
    from kiln_kernels.dsa.triton import indexer_topk, shared_values, sparse_attention

    B, T, H, D, E = 1, 40, 4, 24, 16
    idx = indexer_topk(*indexer_inputs(B, T, 4, 16, torch.float32, seed=5), starts(B, T, False), 8)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    q = torch.randn(B, T, H, D, device=DEVICE, generator=g).requires_grad_()
    k = torch.randn(B, T, 1, D, device=DEVICE, generator=g).requires_grad_(alias == "detached")
    v = (k.detach() if alias == "detached" else k)[..., :E].requires_grad_()
    assert shared_values(k, v)
    do = torch.randn(B, T, H, E, device=DEVICE, generator=g)
    sparse_attention(q, k, v, idx, D**-0.5).backward(do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    R.sparse_attention(q64, k64, v64, idx, D**-0.5).backward(do.double())
    assert rel(v.grad, v64.grad) < TOL[torch.float32] and rel(q.grad, q64.grad) < TOL[torch.float32]
    assert (k.grad is None) if alias != "detached" else rel(k.grad, k64.grad) < TOL[torch.float32]


def test_topk_at_least_the_length_is_dense_causal_attention():
    from kiln_kernels.dsa.triton import indexer_topk, sparse_attention

    B, T, H, D = 2, 45, 4, 32
    idx = indexer_topk(*indexer_inputs(B, T, 2, 16, torch.float32, seed=3), starts(B, T, False), T)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v = (torch.randn(B, T, H, D, device=DEVICE, generator=g) for _ in range(3))
    got = sparse_attention(q, k, v, idx, D**-0.5)
    want = F.scaled_dot_product_attention(*(x.transpose(1, 2).double() for x in (q, k, v)), is_causal=True)
    assert rel(got, want.transpose(1, 2)) < 1e-5


@gpu_only
def test_dispatch_and_the_model(monkeypatch):
    """The DSA block on CUDA (kernels) equals itself with KILN_KERNELS=reference: output,
    indexer loss and every parameter's gradient."""
    from engine.model.common.dsa import GatedDSAttention

    torch.manual_seed(0)
    m = (
        GatedDSAttention(
            hidden=256,
            heads=8,
            q_lora_rank=64,
            kv_lora_rank=128,
            qk_nope=32,
            qk_rope=16,
            v_dim=32,
            index_heads=8,
            index_head_dim=32,
            index_topk=64,
        )
        .cuda()
        .train()
    )
    x = torch.randn(2, 200, 256, device="cuda")
    docs = torch.tensor([[0] * 80 + [1] * 120, [0] * 200], device="cuda")
    pos = torch.cat([torch.arange(80), torch.arange(120)]).cuda()[None].expand(2, -1)
    dy = torch.randn(2, 200, 256, device="cuda")

    def run():
        m.zero_grad()
        out = m(x, pos, docs)
        ((out * dy).sum() + m.last_indexer_loss).backward()  # as the step: the kernels' loss from its backward
        return out.detach(), float(m.last_indexer_loss.detach()), {n: p.grad.clone() for n, p in m.named_parameters()}

    out, loss, grads = run()
    monkeypatch.setenv("KILN_KERNELS", "reference")
    out_r, loss_r, grads_r = run()
    assert rel(out, out_r) < 1e-4 and abs(loss - loss_r) < 1e-4 * abs(loss_r)
    for n in grads:
        assert rel(grads[n], grads_r[n]) < 1e-4, n
