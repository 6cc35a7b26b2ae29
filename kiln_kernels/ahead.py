"""Compiling a pass's Triton kernels side by side, before it runs (``compiling_ahead``).

A cold first step compiles each kernel the moment it first launches, one after another: on the
H200 a Kimi-Linear step's 21-27 compiles summed 14.7 s of its 22.8 s, and each kernel's launcher
(a C module gcc builds) waits its turn too. Inside ``compiling_ahead`` a Triton launch does not
run: it hands its kernel's compile (and launcher build) to a pool of threads and returns at once
(Triton's own asynchronous compile mode, with ``warmup``: nothing is launched, nothing written).
So a pass over a real batch inside it, a *rehearsal*, names every kernel of the step with the
step's own shapes and dtypes (what a kernel is specialised on), in about the host time of a
forward and backward; the context's exit waits for the slowest compile. Triton's compiler
releases the GIL and ptxas and gcc are processes of their own, so the compiles overlap.

Everything else in the rehearsal runs for real on the outputs of kernels that never ran (whatever
the allocator held): the caller throws its results away (engine/training/step.py ``rehearse``).
Kernels' integer outputs never choose an index or a size on the host here, so that garbage stays
arithmetic. A compile that fails in the rehearsal is dropped: the real launch compiles it again
and raises where it always did.
"""

from __future__ import annotations

import inspect
import logging
import os
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

THREADS = "kiln-compile"  # the compile threads' name prefix (a compile listener tells them apart)
log = logging.getLogger(__name__)


class _Pool(ThreadPoolExecutor):
    """Threads that compile a kernel and then build its launcher and load its binary on ``device``
    (what the kernel's first launch would do next, in turn)."""

    def __init__(self, threads: int, device: Any, driver: Any):
        super().__init__(threads, thread_name_prefix=THREADS)
        self.device, self.driver = device, driver

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]  # same call, the handles added
        def compile_and_load():
            kernel = fn(*args, **kwargs)
            self.driver.active.set_current_device(self.device)
            kernel._init_handles()  # the launcher (gcc) and the module load: Triton does this lazily
            return kernel

        return super().submit(compile_and_load)


@contextmanager
def compiling_ahead() -> Iterator[bool]:
    """Triton launches inside compile (as many at a time as there are CPUs, at most 32) and do
    not run; on exit every compile has finished and sits in its kernel's cache, as if it had
    launched. Yields False, and changes nothing, where Triton or its asynchronous compile mode is
    missing or no device is active (the CPU)."""
    try:
        from triton.runtime import _async_compile, driver
        from triton.runtime.jit import JITFunction

        device = driver.active.get_current_device()
        ok = {"grid", "warmup"} <= set(inspect.signature(JITFunction.run).parameters)
    except Exception:  # no triton, an older one, or no device: nothing to compile ahead for
        ok = False
    if not ok:  # (or a Triton whose launch takes other arguments than upstream 3.6's)
        yield False
        return
    run = JITFunction.run
    pool = _Pool(min(32, os.cpu_count() or 1), device, driver)
    mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)

    def rehearsed(self, *args, grid, warmup, **kwargs):
        # autograd runs a CUDA backward in its own thread, where the mode (a context variable) is
        # unset: set it for the call
        token = _async_compile.active_mode.set(mode) if _async_compile.active_mode.get() is None else None
        try:
            return run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            if token is not None:
                _async_compile.active_mode.reset(token)

    JITFunction.run = rehearsed  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        with mode:  # its exit waits for every compile and puts each kernel in its cache
            yield True
            passed = time.perf_counter()
        log.info(
            "the pass %.2f s, then %.2f s for the compiles still running; %.1f GB resident at most",
            passed - start,
            time.perf_counter() - passed,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
        )
    finally:
        JITFunction.run = run  # type: ignore[method-assign]
        pool.shutdown()
