"""A first step's compiles in processes (kiln_kernels.ahead), on the CPU: Triton compiles for the
H100 (sm_90) without a device. A compile as Triton 3.6's asynchronous mode hands it to the
rehearsal's threads is described for a spawned process (``_described``: the closure's source,
target, options), the process compiles it into Triton's disk cache (``_compile``), and the same
compile in this process is then a cache hit, so a thread only reads it. The launcher and the
module load need a device: tests/gpu/test_rehearse_cuda.py covers them. triton lives in .triton
(scripts/test.sh), so the check runs in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.interpret import triton_env

ROOT = Path(__file__).resolve().parents[2]
CHECK = r"""
import multiprocessing, sys
from concurrent.futures import Executor, Future, ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, CompiledKernel, compile, make_backend
from triton.runtime import _async_compile

from kiln_kernels import ahead
from kiln_kernels.kda import chunk_fwd

TARGET = GPUTarget("cuda", 90, 32)


class Grab(Executor):  # the rehearsal's pool stand-in: keeps the compile it is handed
    def __init__(self):
        self.handed = []

    def submit(self, fn, /, *args, **kwargs):
        self.handed.append(fn)
        done = Future()
        done.set_result(None)
        return done


def handed(fn, signature, attrs):
    '''The compile of ``fn`` Triton's asynchronous mode hands its executor (JITFunction._do_compile,
    as a launch inside kiln_kernels.ahead.compiling_ahead reaches it).'''
    backend = make_backend(TARGET)  # what JITFunction.create_binder sets up on a device
    fn.CompiledKernel, fn.compile, fn.ASTSource = CompiledKernel, compile, ASTSource
    fn.device_caches[0] = ({}, {}, TARGET, backend, None)
    grab = Grab()
    token = _async_compile.active_mode.set(_async_compile.AsyncCompileMode(grab))
    try:
        fn._do_compile("key", signature, 0, {}, backend.parse_options({"num_warps": 4}), attrs, True)
    finally:
        _async_compile.active_mode.reset(token)
    (compile_fn,) = grab.handed
    return compile_fn


compile_fn = handed(
    chunk_fwd._solve,
    {"AKK": "*fp32", "MI": "*bf16", "CHUNKS": "*i32", "H": "i32"},
    {(i,): [["tt.divisibility", 16]] for i in range(4)},
)
job = ahead._described(compile_fn)
assert job is not None and job[:2] == ("kiln_kernels.kda.chunk_fwd", "_solve"), job
assert ahead._described(lambda: None) is None  # not a compile Triton handed over: the thread's
with ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=ahead._child_start) as p:
    secs = p.submit(ahead._compile, *job, triton.knobs.cache.dir).result()
assert secs > 0

hits = []
triton.knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: hits.append(cache_hit)
kernel = compile_fn()  # what the rehearsal's thread runs next
assert hits == [True], hits  # read from the cache the process filled, not compiled again
assert "cubin" in kernel.asm and kernel.metadata.target == TARGET
print("ok", round(secs, 2))
"""


def test_a_compile_made_in_a_spawned_process_is_read_from_the_cache(tmp_path):
    env = triton_env(TRITON_CACHE_DIR=str(tmp_path / "cache"))  # fresh: a hit is the process's work
    run = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.startswith("ok"), run.stdout


def test_a_job_that_ends_before_its_first_step_stops_the_compile_processes(tmp_path):
    """The trainer starts the compile processes before its checkpoint loads (on a GPU); a job that
    fails before its first step's rehearsal used them still ends them (engine.train), here a
    pool of one standing in for start_compilers's on this CPU machine."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import pytest

    import engine
    from engine.reporting import RecordingReporter
    from kiln.dataset import DatasetError
    from kiln.spec import JobSpec, LoraSpec
    from kiln.store import LocalStore
    from kiln_kernels import ahead
    from tests.conftest import running, wait_for

    pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))
    assert pool.submit(int, "7").result() == 7
    workers = [w.pid for w in pool._processes.values()]
    ahead._processes = pool
    sample = ROOT / "data" / "sample"
    job = JobSpec(
        job_id="ftjob-early-end",
        model="kiln-tiny",
        training_file=str(sample / "train.jsonl"),
        images_file=str(sample / "images.zip"),
        max_seq_len=40,  # every example is longer: the job fails as it reads the data
        lora=LoraSpec(rank=4),
    )
    with pytest.raises(DatasetError):
        engine.train(job, LocalStore(tmp_path), RecordingReporter())
    assert ahead._processes is None
    wait_for(lambda: not any(running(pid) for pid in workers), 30, 0.1, "the compile process to end")
