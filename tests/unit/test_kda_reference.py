"""The KDA reference: chunked form == recurrent form, forward and every gradient, ragged and
variable-length; parity with fla-core's own naive implementations."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln_kernels.kda import kda_chunk, kda_gate, kda_recurrent


def rel(a, b):
    return float((a - b).norm() / b.norm())


def inputs(B, T, H, K, V, dtype=torch.float64, seed=0, state=False, grad=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    x = {
        "q": F.normalize(r(B, T, H, K), dim=-1),
        "k": F.normalize(r(B, T, H, K), dim=-1),
        "v": r(B, T, H, V),
        "g": kda_gate(r(B, T, H, K), r(H) * 0.5, r(H, K)).to(dtype),
        "beta": torch.sigmoid(r(B, T, H)),
    }
    if state:
        x["initial_state"] = r(B, H, K, V)
    if grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


@pytest.mark.parametrize(
    "B,T,H,K,V,C", [(1, 64, 1, 8, 8, 16), (2, 100, 3, 16, 8, 16), (1, 37, 2, 32, 16, 64), (2, 130, 4, 16, 32, 32)]
)
def test_chunk_equals_recurrent(B, T, H, K, V, C):
    x = inputs(B, T, H, K, V, seed=T, state=T % 2 == 0)
    o1, s1 = kda_recurrent(**x)
    o2, s2 = kda_chunk(**x, chunk_size=C)
    assert o1.shape == (B, T, H, V) and s1.shape == (B, H, K, V)
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12


def test_every_gradient_matches():
    x = inputs(2, 45, 2, 8, 8, seed=3, state=True, grad=True)
    o1, s1 = kda_recurrent(**x)
    w_o, w_s = torch.randn_like(o1), torch.randn_like(s1)
    g1 = torch.autograd.grad((o1 * w_o).sum() + (s1 * w_s).sum(), list(x.values()))
    o2, s2 = kda_chunk(**x, chunk_size=16)
    g2 = torch.autograd.grad((o2 * w_o).sum() + (s2 * w_s).sum(), list(x.values()))
    for name, a, b in zip(x, g2, g1, strict=True):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-10, name


def test_fp32_chunk_against_fp64():
    x = inputs(1, 200, 4, 32, 32, seed=9)
    ref, _ = kda_recurrent(**x)
    got, _ = kda_chunk(**{k: v.float() for k, v in x.items()})
    assert got.dtype == torch.float32 and rel(got.double(), ref) < 1e-5


def test_variable_length_resets_the_state_per_sequence():
    lens = [5, 64, 0, 1, 30]  # an empty sequence: its initial state is its final one
    x = inputs(1, sum(lens), 2, 8, 4, seed=5)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    h0 = torch.randn(len(lens), 2, 8, 4, dtype=torch.float64)
    for fn in (kda_recurrent, lambda **a: kda_chunk(**a, chunk_size=16)):
        o, S = fn(**x, initial_state=h0, cu_seqlens=cu)
        assert S.shape == (5, 2, 8, 4) and torch.equal(S[2], h0[2])
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            alone, s_alone = kda_recurrent(**{k: v[:, a:b] for k, v in x.items()}, initial_state=h0[n : n + 1])
            assert o[:, a:b].shape == alone.shape and (a == b or rel(o[:, a:b], alone) < 1e-12)
            assert rel(S[n : n + 1], s_alone) < 1e-12
    with pytest.raises(ValueError, match="batch of 1"):
        kda_chunk(**inputs(2, 10, 1, 4, 4), cu_seqlens=torch.tensor([0, 10]))


def test_gate_forms():
    g_raw, A_log, bias = torch.randn(2, 5, 3, 4), torch.randn(3), torch.randn(3, 4)
    g = kda_gate(g_raw, A_log, bias)
    assert torch.allclose(g, -A_log.exp()[:, None] * F.softplus(g_raw + bias)) and (g <= 0).all()
    safe = kda_gate(g_raw * 100, A_log, bias, lower_bound=-5.0)
    assert (safe >= -5).all() and (safe <= 0).all()


def fla_naive():
    """fla-core's naive KDA, loaded by path: importing fla itself would pull in triton."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed (scripts/test.sh installs it without its triton dependency)")
    path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def test_parity_with_fla_naive():
    fla = fla_naive()
    x = inputs(2, 128, 2, 16, 16, seed=11, state=True)
    ours, s_ours = kda_chunk(**x, chunk_size=64)
    theirs, s_theirs = fla.naive_recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    # fla's naive forms compute in fp32 whatever they are given: ARCHITECTURE's fp32 bound applies
    assert rel(ours, theirs) < 1e-5 and rel(s_ours, s_theirs) < 1e-5
    theirs_chunk, _ = fla.naive_chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    assert rel(ours, theirs_chunk) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_decode_step_is_the_recurrence_at_one_token(dtype):
    """kda_step (the decoder's batched step) against kda_recurrent over one token of each of N
    sequences from their states: the output and the new states, a scale given or not."""
    from kiln_kernels.kda import kda_step

    x = inputs(5, 1, 3, 16, 8, dtype=dtype, seed=3, state=True)
    for scale in (None, 0.3):
        want_o, want_s = kda_recurrent(**x, scale=scale)
        o, s = kda_step(*(x[n][:, 0] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], scale)
        assert o.dtype == dtype and o.shape == (5, 3, 8) and s.shape == want_s.shape
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        assert rel(o, want_o[:, 0]) < tol and rel(s, want_s) < tol
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a decoder under autocast: the state stays exact
            o2, s2 = kda_step(*(x[n][:, 0] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], scale)
        assert s2.dtype == s.dtype and torch.equal(s2, s) and torch.equal(o2, o)
