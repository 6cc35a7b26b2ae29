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

Threads alone leave most of a cold first step's compiling in it: Triton's front end (Python,
under the GIL) serialises them, and at 128k tokens on an H100 the compiles outlasted the pass by
4.6 s of a 9.9 s first step. So where ``start_compilers`` ran first (the trainer calls it before
the checkpoint loads, as a spawned process takes seconds to import Triton and the kernels), each
compile a thread is handed goes, as it is named, to a process of its own: the process compiles it
and builds its launcher into Triton's disk cache, and the thread then reads both from there and
loads the binary. A compile the processes cannot take (a kernel not named by its module, an
argument that does not pickle) the thread compiles itself.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import multiprocessing
import os
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

THREADS = "kiln-compile"  # the compile threads' name prefix (a compile listener tells them apart)
log = logging.getLogger(__name__)


_processes: ProcessPoolExecutor | None = None  # start_compilers's, until a rehearsal has used them


def start_compilers(processes: int | None = None) -> bool:
    """Spawn the processes the next ``compiling_ahead`` hands its compiles to (by default one a
    CPU of this rank's share of the host, at most 32), so that they have started (imported Triton
    and the kernels' modules) by the time it runs: call it before loading a checkpoint. False,
    and nothing spawned, where the active device is not CUDA (the CPU: no Triton or no driver;
    an NPU's compiler is another)."""
    global _processes
    if _processes is not None:
        return True
    try:
        from triton.runtime import driver

        if driver.active.get_current_target().backend != "cuda":
            return False
    except Exception:
        return False
    if processes is None:
        cpus = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        processes = max(1, min(32, cpus))
    pool = ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), initializer=_child_start)
    try:
        for _ in range(processes):  # one task each: the pool spawns a process a task while none is idle
            pool.submit(time.sleep, 0.5)
    except Exception as e:  # (a process that may not have children): the threads compile alone
        log.warning("no compile processes: %s: %s", type(e).__name__, e)
        pool.shutdown(wait=False, cancel_futures=True)
        return False
    _processes = pool
    return True


def stop_compilers() -> None:
    """Shut ``start_compilers``'s processes down, where no rehearsal has (a job that ended before
    its first step): their memory back at once."""
    global _processes
    if _processes is not None:
        _processes.shutdown(wait=False, cancel_futures=True)
        _processes = None


def _child_start() -> None:
    """A compile process's start: every op's CUDA module (kiln_kernels.dispatch.OPS, and the
    kernels they import), so that no compile waits for an import."""
    from kiln_kernels.dispatch import OPS

    for name in {op.cuda for op in OPS.values() if op.cuda}:
        try:
            importlib.import_module(name)
        except Exception:  # a module that does not import here is compiled by the threads
            pass


def _kernel(module: str, name: str) -> Any:
    """The JIT function ``name`` of ``module`` (under any autotuner or heuristics around it)."""
    fn = getattr(importlib.import_module(module), name, None)
    while fn is not None and not hasattr(fn, "device_caches"):
        fn = getattr(fn, "fn", None)
    return fn


def _compile(module: str, name: str, how: dict, cache: str) -> float:
    """In a compile process: compile ``how`` into Triton's cache at ``cache``, and build the
    kernel's launcher into it too (where a CUDA driver is: else the thread builds it); seconds."""
    import triton
    from triton.compiler import ASTSource

    start = time.perf_counter()
    triton.knobs.cache.dir = cache
    src = ASTSource(_kernel(module, name), how["signature"], how["constants"], how["attrs"])
    kernel = triton.compile(src, target=how["target"], options=how["options"], _env_vars=how["env_vars"])
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:
        pass
    return time.perf_counter() - start


def _described(compile_fn) -> tuple[str, str, dict] | None:
    """What a compile process needs to make the compile ``compile_fn`` stands for: the closure
    Triton 3.6's asynchronous mode hands its executor (``JITFunction._do_compile``) holds the
    source, target, options and cache-invalidating variables. None where it does not, or its
    kernel is not its module's attribute of its name (a kernel made in a function)."""
    try:
        values = (c.cell_contents for c in compile_fn.__closure__)
        cells = dict(zip(compile_fn.__code__.co_freevars, values, strict=True))
        src = cells["src"]
        module, name = src.fn.module, src.fn.fn.__qualname__
        if _kernel(module, name) is not src.fn:
            return None
        how = dict(signature=src.signature, constants=src.constants, attrs=src.attrs, target=cells["target"])
        return module, name, how | dict(options=cells["options"].__dict__, env_vars=cells["env_vars"])
    except Exception:
        return None


class _Pool(ThreadPoolExecutor):
    """Threads that compile a kernel (by a process of ``processes`` where there are) and then
    build its launcher and load its binary on ``device`` (what the kernel's first launch would do
    next, in turn)."""

    def __init__(self, threads: int, device: Any, driver: Any, processes: ProcessPoolExecutor | None):
        super().__init__(threads, thread_name_prefix=THREADS)
        self.device, self.driver, self.processes = device, driver, processes
        self.in_processes: list[float] = []  # each compile a process made: its seconds

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]  # same call, the handles added
        job = _described(fn) if self.processes is not None else None
        if job is not None:
            from triton import knobs

            made = self.processes.submit(_compile, *job, knobs.cache.dir)  # type: ignore[union-attr]

        def compile_and_load():
            if job is not None:
                try:
                    self.in_processes.append(made.result())
                except Exception as e:  # compiled here instead (and raised here, if it fails again)
                    log.debug("a compile process did not compile %s: %s: %s", job[1], type(e).__name__, e)
            kernel = fn(*args, **kwargs)  # from the cache, where a process compiled it
            self.driver.active.set_current_device(self.device)
            kernel._init_handles()  # the launcher (gcc) and the module load: Triton does this lazily
            return kernel

        return super().submit(compile_and_load)


@contextmanager
def compiling_ahead() -> Iterator[bool]:
    """Triton launches inside compile (as many at a time as there are CPUs, at most 32; in
    ``start_compilers``'s processes where they run, which it then shuts down) and do not run; on
    exit every compile has finished and sits in its kernel's cache, as if it had launched. Yields
    False, and changes nothing, where Triton or its asynchronous compile mode is missing or no
    device is active (the CPU)."""
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
    pool = _Pool(min(32, os.cpu_count() or 1), device, driver, _processes)
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
            "the pass %.2f s, then %.2f s for the compiles still running (%d of %d by the compile"
            " processes, %.1f s summed); %.1f GB resident at most",
            passed - start,
            time.perf_counter() - passed,
            len(pool.in_processes),
            len(mode.raw_futures),
            sum(pool.in_processes),
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
        )
    finally:
        JITFunction.run = run  # type: ignore[method-assign]
        pool.shutdown()
        stop_compilers()  # a process's first step is its one rehearsal: their memory back
