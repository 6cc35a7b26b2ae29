"""Swap Core on a GPU (skipped elsewhere): with bf16 autocast the host tier's side-stream copies
give gradients bit-equal to a run without recompute, quantized caches stay close, and the kept
activations leave the device."""

from __future__ import annotations

import pytest
import torch

from bench.swap_core import ALL, bench_config, build, rel_err, unwrap
from engine.memory import apply_swap_core
from kiln.spec import MemorySpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def step(model, ids, spec: MemorySpec) -> tuple[dict, float, object]:
    unwrap(model)
    core = apply_swap_core(model, spec)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids)
    torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
    del logits
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    return grads, torch.cuda.max_memory_allocated(), core


@pytest.fixture
def deterministic(monkeypatch):
    """Deterministic kernels: DSA's backward sums its keys' gradients with fp32 atomics otherwise,
    and two runs without recompute already differ (bit-equality is then no test of Swap Core)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_swap_core_on_cuda(deterministic):
    c, _ = bench_config("debug")
    c.hidden, c.kda.heads, c.kda.head_dim = 256, 4, 64
    model = build(c, torch.device("cuda"))
    ids = torch.randint(0, c.vocab_size, (1, 1024), device="cuda")
    ref, peak_none, _ = step(model, ids, MemorySpec())
    again, _, _ = step(model, ids, MemorySpec())
    assert all(torch.equal(ref[n], again[n]) for n in ref)  # the model itself is deterministic here
    for spec in (
        MemorySpec(recompute="full"),
        MemorySpec(recompute="selective"),  # the default: kernels
        MemorySpec(recompute="selective", cache_ops=ALL),
        MemorySpec(recompute="selective", cache_ops=ALL, tier="host"),
        MemorySpec(recompute="selective", cache_ops=["kernels", "projections"], tier="host"),
        MemorySpec(recompute="selective", cache_ops=["kernels", "projections", "experts"], tier="host"),
        MemorySpec(recompute="selective", cache_ops=ALL, tier="auto", device_budget_mb=1.0),
    ):
        got, peak, core = step(model, ids, spec)
        for n in ref:
            assert torch.equal(got[n], ref[n]), (spec, n)
        if spec.cache_ops == ALL and spec.tier == "device":
            # every matmul's output kept on the device: more than autograd saves without
            # recompute (a linear saves its input, not its output), so no bound by that peak
            assert core.peak["device"] > 0 and core.peak["host"] == 0
        else:
            assert peak < peak_none, spec
        if spec.tier == "host":
            assert core.peak["device"] == 0 and core.peak["host"] > 0
        if spec.tier == "auto":
            assert 0 < core.peak["device"] <= 2**20 < core.peak["host"]
    for kind, bound in (("int8", 0.05), ("fp8", 0.1)):
        got, _, _ = step(model, ids, MemorySpec(recompute="selective", cache_ops=ALL, tier="host", quantize=kind))
        err = rel_err(got, ref)
        assert 0 < err < bound, (kind, err)


def test_the_host_tier_sends_out_all_but_the_last_block():
    """The forward's last block is the backward's first: its kept outputs stay on the device, every
    other block's are in host memory by the backward, and all come back (nothing left kept)."""
    c, _ = bench_config("debug")
    model = build(c, torch.device("cuda"))
    core = apply_swap_core(model, MemorySpec(recompute="selective", cache_ops=["kernels", "projections"], tier="host"))
    ids = torch.randint(0, c.vocab_size, (1, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids)
    where = [{k.data.device.type for k in r().leaves()} for r in core.frames]
    assert len(where) == 2 * c.layers and where[-1] == {"cuda"} and all(w == {"cpu"} for w in where[:-1]), where
    logits.float().logsumexp(-1).mean().backward()
    assert core.live == {"device": 0, "host": 0} and not core.outgoing
