"""On a GPU (skipped elsewhere): a first step's rehearsal (engine.training.step.rehearse) compiles
every Triton kernel of the step in the compile threads, so the step itself compiles none, and
leaves no trace: the gradients it found, the routers' token counts and the random generators are
as before it, bit for bit, and the step's loss and gradients those of the same step without it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.data import Sample
from engine.lora import apply_lora, store_frozen
from engine.model.common.moe import Router
from engine.model.registry import ensure_builtin, load_base
from engine.training.ranks import Single
from engine.training.step import accumulate, rehearse
from kiln.spec import LoraSpec
from kiln_kernels.ahead import THREADS
from tests.tolerance import rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = torch.device("cuda")


def forget_kernels() -> int:
    """Drop every compiled kernel from the processes' kernel caches (Triton's disk cache stays:
    a compile then reads it, still a compile to the listener); how many JIT functions."""
    from triton.runtime.jit import JITFunction

    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("kiln_kernels") and mod is not None:
            for obj in vars(mod).values():
                if isinstance(obj, JITFunction):
                    obj.device_caches.clear()
                    n += 1
    return n


@contextmanager
def compiles_seen() -> Iterator[list[str]]:
    """Triton's compiles while the block runs, each as "thread: kernel" (the rehearsal's run in
    kiln_kernels.ahead's compile threads (names starting THREADS), a launch's in the thread that launched it)."""
    import threading

    import triton

    seen: list[str] = []

    def listen(src, metadata, metadata_group, times, cache_hit):
        seen.append(f"{threading.current_thread().name}: {getattr(getattr(src, 'fn', None), '__name__', '?')}")

    triton.knobs.compilation.listener = listen
    try:
        yield seen
    finally:
        triton.knobs.compilation.listener = None


def model_of(name: str, folder):
    ensure_builtin(name, folder)
    model = load_base(folder)
    experts = [] if name == "kiln-tiny" else ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    apply_lora(model, LoraSpec(rank=8, target_modules=["q_proj", "v_proj", "down_proj"], target_parameters=experts))
    store_frozen(model, torch.bfloat16)
    return model.to(DEV).train()


def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 200, (n,), generator=g) for n in (700, 1, 333, 40)]
    return [Sample(i, d, d.clone(), torch.zeros(0, 3, 1, 1)) for i, d in enumerate(docs)]


def state(model) -> dict:
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "loads": [m.load.clone() for m in model.modules() if isinstance(m, Router) and m.load is not None],
        "rng": (torch.get_rng_state(), torch.cuda.get_rng_state()),
    }


@pytest.mark.parametrize("name", ["kiln-tiny", "kimi-linear-tiny", "kiln-hybrid-tiny"])
def test_rehearsal_compiles_the_step_ahead_and_leaves_no_trace(name, tmp_path):
    model = model_of(name, tmp_path / name)
    ranks = Single(DEV)

    def step(ahead: bool):
        torch.manual_seed(7)
        torch.cuda.manual_seed(7)
        for m in model.modules():
            if isinstance(m, Router):
                m.load = None
        model.zero_grad(set_to_none=True)
        forget_kernels()
        out = accumulate(model, samples(), 1, 0, 1024, ranks, ahead=ahead)
        return out, state(model)

    want, want_state = step(False)
    _, again = step(False)  # the same step again: how far the backward's atomic sums move it (DSA)
    noise = {n: rel(again["grads"][n], g) for n, g in want_state["grads"].items()}
    with compiles_seen() as compiles:
        assert forget_kernels()
        batch, cp, _ = ranks.batch(samples(), 0, 1024)
        torch.manual_seed(3)
        before = state(model)
        assert rehearse(model, batch, DEV, cp)
        after = state(model)
        assert compiles and all(t.startswith(THREADS) for t in compiles), compiles
        assert after["grads"].keys() == before["grads"].keys()
        assert all(torch.equal(after["grads"][n], g) for n, g in before["grads"].items())
        assert all(torch.equal(a, b) for a, b in zip(after["loads"], before["loads"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(after["rng"], before["rng"], strict=True))
        # the step with its rehearsal: every compile in the compile threads, none at a launch (one
        # micro-batch: a later one of other lengths may need a kernel specialised otherwise, which
        # it compiles as it launches; seen for the hybrid's norm backward)
        compiles.clear()
        got, got_state = step(True)
        late = [t for t in compiles if not t.startswith(THREADS)]
        assert compiles and not late, late
    # the same step: equal but for the order of the backward's atomic sums (the hybrid's DSA: a
    # second run without the rehearsal came out bit-equal in one try and 4e-3 away in another),
    # within bf16's tolerance (ARCHITECTURE.md); gradients the rehearsal had touched would be garbage
    loss, targets, right, tokens, rows = got
    assert (targets, int(right), tokens, rows) == (want[1], int(want[2]), *want[3:])
    assert abs(float(loss) - float(want[0])) < 1e-4 * abs(float(want[0]))
    assert got_state["grads"].keys() == want_state["grads"].keys()
    for n, g in want_state["grads"].items():
        assert rel(got_state["grads"][n], g) <= max(4 * noise[n], 1e-2), (n, noise[n])
    assert all(torch.equal(a, b) for a, b in zip(got_state["loads"], want_state["loads"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_state["rng"], want_state["rng"], strict=True))


@pytest.mark.parametrize("doc", [None, 4096])  # one document, or 4k documents packed
def test_a_long_row_rehearsed_on_a_slice_leaves_the_step_nothing_to_compile(doc, tmp_path):
    """A row over twice REHEARSAL_SLICE is rehearsed on a shorter slice of it
    (engine.training.step.rehearsal): the slice's specialisations are the row's, so the step
    launches every kernel from the compile threads' cache."""
    from engine.training.step import REHEARSAL_SLICE

    model = model_of("kimi-linear-tiny", tmp_path / "m")
    T = 2 * REHEARSAL_SLICE + 5000 + 3
    g = torch.Generator().manual_seed(2)
    sizes = [T] if doc is None else [doc] * (T // doc) + [T % doc]
    docs = [torch.randint(3, 200, (n,), generator=g) for n in sizes]
    forget_kernels()
    with compiles_seen() as compiles:
        samples = [Sample(i, d, d.clone(), torch.zeros(0, 3, 1, 1)) for i, d in enumerate(docs)]
        loss = accumulate(model, samples, 1, 0, T, Single(DEV), ahead=True)[0]
        assert torch.isfinite(loss)
    assert compiles and not [t for t in compiles if not t.startswith(THREADS)], compiles


def test_on_a_cold_cache_the_compile_processes_make_every_compile(tmp_path):
    """With start_compilers's processes (the trainer starts them before the checkpoint loads), a
    rehearsal on an empty Triton cache hands each compile to a process: what the compile threads
    then compile is read from the cache the processes filled, and the step after it compiles
    nothing at a launch."""
    import triton

    from kiln_kernels import ahead

    model = model_of("kimi-linear-tiny", tmp_path / "m")
    cache = triton.knobs.cache.dir
    triton.knobs.cache.dir = str(tmp_path / "cache")
    try:
        assert ahead.start_compilers(4)
        forget_kernels()
        hits: list[tuple[str, bool]] = []

        def listen(src, metadata, metadata_group, times, cache_hit):
            import threading

            hits.append((threading.current_thread().name, cache_hit))

        triton.knobs.compilation.listener = listen
        try:
            loss = accumulate(model, samples(), 1, 0, 1024, Single(DEV), ahead=True)[0]
        finally:
            triton.knobs.compilation.listener = None
        assert torch.isfinite(loss)
        assert ahead._processes is None  # shut down after the rehearsal
        assert hits and all(t.startswith(THREADS) and hit for t, hit in hits), hits
    finally:
        triton.knobs.cache.dir = cache
