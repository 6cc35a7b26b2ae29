"""The Triton KDA (kiln_kernels/kda/triton.py) against the float64 reference on fresh random inputs:
the output, the final state and the gradients of q, k, v, g, beta and the initial state, with
ragged variable-length batches (sequences shorter than a row block, longer than a chunk), plain
batches, fp32 and bf16. On a CPU the fp32 cases run through Triton's interpreter
(tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln_kernels.kda import reference
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def case(B, T, H, K, V, dtype, seed, state, lower_bound=None):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=g)
    x = {
        "q": F.normalize(r(B, T, H, K), dim=-1).to(dtype),
        "k": F.normalize(r(B, T, H, K), dim=-1).to(dtype),
        "v": r(B, T, H, V).to(dtype),
        "g": reference.kda_gate(r(B, T, H, K), r(H) * 0.5, r(H, K), lower_bound),
        "beta": torch.sigmoid(r(B, T, H)).to(dtype),
    }
    if state:
        x["initial_state"] = r(B, H, K, V)
    return {n: t.requires_grad_() for n, t in x.items()}


def check(x, cu, dtype, N):
    from kiln_kernels.kda import triton as fast

    o, ht = fast.kda_chunk(**x, cu_seqlens=cu)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    do = torch.randn(o.shape, device=DEVICE, generator=g)
    dht = torch.randn(ht.shape, device=DEVICE, generator=g)
    ((o * do).sum() + (ht * dht).sum()).backward()
    x64 = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o64, ht64 = reference.kda_chunk(**x64, cu_seqlens=cu)
    ((o64 * do.double()).sum() + (ht64 * dht.double()).sum()).backward()
    assert o.dtype == x["v"].dtype and o.shape == o64.shape and ht.shape == ht64.shape == (N, *ht.shape[1:])
    tol = TOL[dtype]
    assert rel(o, o64) < tol and rel(ht, ht64) < tol
    for n in x:
        assert x[n].grad.dtype == x[n].dtype, n
        assert rel(x[n].grad, x64[n].grad) < tol, (n, rel(x[n].grad, x64[n].grad))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "lens,H,K,V,state,lower_bound",
    [
        ([5, 70, 0, 64, 1, 130], 2, 16, 32, True, None),  # an empty sequence among them
        ([200], 1, 32, 16, False, -5.0),
        ([40, 90], 1, 128, 16, True, None),  # K in two blocks of 64
        pytest.param([3000, 17, 1000, 4000], 4, 128, 128, True, -5.0, marks=gpu_only),
        pytest.param([8192], 2, 128, 64, False, None, marks=gpu_only),
    ],
)
def test_variable_length_matches_the_reference(lens, H, K, V, state, lower_bound, dtype):
    cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0)
    x = case(1, sum(lens), H, K, V, dtype, sum(lens) + K, False, lower_bound)
    if state:  # in the inputs' dtype: its gradient comes back in it
        g = torch.Generator(device=DEVICE).manual_seed(1)
        x["initial_state"] = torch.randn(len(lens), H, K, V, device=DEVICE, generator=g).to(dtype).requires_grad_()
    check(x, cu, dtype, len(lens))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
def test_steep_decay(dtype):
    """A head whose decay over a row block of 16 exceeds e^80 (a diagonal block the factored
    product cannot hold: the kernels go token by token there) beside an ordinary one."""
    x = case(1, 150, 2, 32, 16, dtype, 3, False)
    with torch.no_grad():
        x["g"][:, :, 1] *= 30  # about -20 a token
    check(x, torch.tensor([0, 40, 150], device=DEVICE), dtype, 2)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "B,T,H,K,V", [(2, 100, 2, 16, 16), (1, 80, 1, 16, 64), pytest.param(3, 1000, 8, 128, 128, marks=gpu_only)]
)
def test_batch_matches_the_reference(B, T, H, K, V, dtype):
    check(case(B, T, H, K, V, dtype, B * T, True), None, dtype, B)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "lower_bound,bias,trained", [(None, True, True), (-5.0, True, True), (-5.0, False, False), (None, True, False)]
)
def test_the_gate_matches_the_reference(lower_bound, bias, trained, dtype):
    """kiln_kernels/kda/gate.py: g and the gradients of g_raw, A_log and dt_bias (when they train)
    against the float64 definition; g_raw spans softplus's threshold (|x| up to ~25)."""
    from kiln_kernels.kda import gate

    g = torch.Generator(device=DEVICE).manual_seed(3)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=g)
    raw = (r(2, 37, 3, 20) * 8).to(dtype).requires_grad_()
    A = (r(3) * 0.5).requires_grad_(trained)
    b = (r(3, 20) * 0.5).requires_grad_(trained) if bias else None
    out = gate.kda_gate(raw, A, b, lower_bound)
    dg = r(*out.shape)
    out.backward(dg)
    ins = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in (raw, A, b)]
    want = reference.kda_gate(*ins, lower_bound)
    want.backward(dg.double())
    assert out.dtype == torch.float32 and rel(out, want) < 1e-5  # fp32 math from the same inputs
    assert raw.grad.dtype == dtype and rel(raw.grad, ins[0].grad) < TOL[dtype]
    if trained:
        assert rel(A.grad, ins[1].grad) < 1e-5 and (b is None or rel(b.grad, ins[2].grad) < 1e-5)
    else:
        assert A.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize("lower_bound,bias,trained", [(None, True, True), (-5.0, True, False), (-5.0, False, True)])
def test_the_gate_inside_the_kernels(lower_bound, bias, trained, dtype):
    """``kda_chunk(..., gate=...)`` makes the decay inside its cumulative sum: the same output,
    final state and gradients as the gate's own kernels followed by ``kda_chunk`` (the same fp32
    math in the same order: bit for bit in fp32), and the gradients of g_raw, A_log and dt_bias against
    the float64 definition. Packed documents, one of them empty, one shorter than a row block."""
    from kiln_kernels.kda import Gate, gate
    from kiln_kernels.kda import triton as fast

    lens, H, K, V = [5, 40, 0, 70], 2, 32, 16
    cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0)
    x = case(1, sum(lens), H, K, V, dtype, 11, False)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=g)
    raw = (r(1, sum(lens), H, K) * 4).to(dtype).requires_grad_()
    A = (r(H) * 0.5).requires_grad_(trained)
    b = (r(H, K) * 0.5).requires_grad_(trained) if bias else None
    do, dht = r(1, sum(lens), H, V), r(len(lens), H, K, V)

    def run(inside: bool):
        ins = {n: t.detach().requires_grad_() for n, t in x.items() if n != "g"}
        r_ = raw.detach().requires_grad_()
        if inside:
            o, ht = fast.kda_chunk(**ins, g=r_, cu_seqlens=cu, gate=Gate(A, b, lower_bound))
        else:
            o, ht = fast.kda_chunk(**ins, g=gate.kda_gate(r_, A, b, lower_bound), cu_seqlens=cu)
        ((o.float() * do).sum() + (ht * dht).sum()).backward()
        params = [t.grad for t in (A, b) if t is not None and t.requires_grad]
        for t in (A, b):
            if t is not None:
                t.grad = None
        return [o, ht, r_.grad, *(ins[n].grad for n in ("q", "k", "v", "beta")), *params]

    inside, apart = run(True), run(False)
    assert len(inside) == 7 + trained * (1 + bias)
    for a, w in zip(inside, apart, strict=True):  # bf16: the gate compiled into two kernels may
        # differ by an fp32 rounding, which a bf16 output then shows (on the H100, 2026-12-05)
        assert a.dtype == w.dtype and (torch.equal(a, w) if dtype == torch.float32 else rel(a, w) < TOL[dtype])
    ins64 = {n: t.detach().double() for n, t in x.items() if n != "g"}
    raw64 = raw.detach().double().requires_grad_()
    A64 = A.detach().double().requires_grad_(trained)
    b64 = b.detach().double().requires_grad_(trained) if bias else None
    o64, ht64 = reference.kda_chunk(**ins64, g=raw64, cu_seqlens=cu, gate=Gate(A64, b64, lower_bound))
    ((o64 * do.double()).sum() + (ht64 * dht.double()).sum()).backward()
    tol = TOL[dtype]
    assert rel(inside[0], o64) < tol and rel(inside[1], ht64) < tol
    assert inside[2].dtype == dtype and rel(inside[2], raw64.grad) < tol
    if trained:  # sums over every token of dg, whose terms cancel: the looser bound of a sum
        assert rel(inside[7], A64.grad) < 10 * tol and (b is None or rel(inside[8], b64.grad) < 10 * tol)


@gpu_only
@pytest.mark.parametrize("autocast", [False, True])
def test_dispatch_and_the_model(autocast, monkeypatch):
    """The KDA block on CUDA (kernels) against itself in float64 (the references), on packed
    documents: output and every parameter's gradient no further from float64 than the references'
    in the same precision (twice their error at most), in fp32 and under bf16 autocast."""
    import copy

    from engine.model.common.kda import KimiDeltaAttention
    from engine.model.common.layers import cu_seqlens

    torch.manual_seed(0)
    m = KimiDeltaAttention(hidden=256, H=4, K=64, gate_lower_bound=-5.0).cuda().train()
    x = torch.randn(1, 300, 256, device="cuda")
    cu = cu_seqlens(torch.tensor([[0] * 70 + [1] * 200 + [2] * 30], device="cuda"))
    dy = torch.randn(1, 300, 256, device="cuda")

    def run(model, x):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, cu)
        (out.to(x.dtype) * dy.to(x.dtype)).sum().backward()
        return [out.detach(), *(p.grad.clone() for p in model.parameters())]

    truth = run(copy.deepcopy(m).double(), x.double())  # float64 takes the references
    kernels = run(m, x)
    monkeypatch.setenv("KILN_KERNELS", "reference")
    references = run(m, x)
    names = ["output", *(n for n, _ in m.named_parameters())]
    for n, a, r, t in zip(names, kernels, references, truth, strict=True):
        err = rel(a, t)
        assert err < max(2 * rel(r, t), 1e-6), (n, err, rel(r, t))


@gpu_only
def test_a_packed_layer_waits_for_the_device_once():
    """The document offsets come to the host once a forward (engine.model.common.layers.cu_seqlens); the
    KDA kernels, forward and backward, and the short convolution then take them without a host sync
    (each one drained the queue before)."""
    from engine.model.common.kda import KimiDeltaAttention
    from engine.model.common.layers import cu_seqlens

    m = KimiDeltaAttention(hidden=256, H=4, K=64, gate_lower_bound=-5.0).cuda().train()
    x = torch.randn(1, 300, 256, device="cuda", requires_grad=True)
    docs = torch.tensor([[0] * 70 + [1] * 200 + [2] * 30], device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x, cu_seqlens(docs))
        out.float().sum().backward()

    step()  # compiles the kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own warning ("called a synchronizing CUDA operation"), not the one that setting the
    # mode gives in torch >= 2.10 ("Synchronization debug mode is a prototype feature")
    where = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]
    assert len(where) == 1 and where[0].startswith("layers.py:"), where
