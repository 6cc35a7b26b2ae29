"""A job on several processes: ``engine.train`` calls ``run`` when ``spec.parallel.nproc`` > 1.

``run`` starts torchrun (one node, ``nproc`` processes: one per GPU or NPU, never more than the
process sees, ``check_devices``; or gloo on the CPU) with this module as the program, and stays
in the caller's process as the go-between: rank 0 writes its reporter calls as JSON lines into
``events.jsonl``, which ``run`` replays into the caller's reporter as they come; when the caller's
reporter says stop, ``run`` writes the reason into ``stop``, which rank 0 reads at the next step
boundary and tells the others. Rank 0 ends with a ``result`` line (the TrainResult) or an
``error`` line (the exception's type and message, raised again here: a dataset error stays a
dataset error).

The ranks open the caller's store again by its URL (``kiln.store.open_store``; an S3 store with
the caller's cache folder: one node, one cache). On several nodes, start this module with torchrun
on each node (``--nnodes``, ``--rdzv-endpoint``) and a store folder every node sees (rank 0
publishes a checkpoint folder the other ranks write their shards into); see README,
"Multi-GPU and multi-node".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from engine.reporting import FileReporter, SilentReporter
from engine.spec import Reporter, Store, TrainResult
from kiln.spec import JobSpec

POLL_S = 0.2


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the launching process dies; torchrun then
    stops its ranks."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _replay(line: str, reporter: Reporter) -> dict | None:
    """Hand one event to the caller's reporter; return it if it ends the run."""
    e = json.loads(line)
    kind = e.pop("kind")
    if kind in ("result", "error"):
        return {"kind": kind, **e}
    getattr(reporter, kind)(**e)
    return None


def check_devices(nproc: int) -> None:
    """A job of ``nproc`` ranks on this node takes one accelerator each: refuse more ranks than
    this process sees (``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` narrow them). On
    the CPU the ranks are gloo processes: no limit."""
    from engine import device

    kind = device.best()
    if kind == "cpu":
        return
    seen, env = device.count(kind), device.VISIBLE_ENV[kind]
    if nproc > seen:
        raise ValueError(
            f"hyperparameters.parallel.nproc ({nproc}) is more than the {seen} {kind} device(s) this "
            f"worker sees ({env}={os.environ.get(env, 'unset')}): one process per device"
        )


def run(spec: JobSpec, store: Store, reporter: Reporter) -> TrainResult:
    check_devices(spec.parallel.nproc)
    url = getattr(store, "url", None)
    if url is None:
        raise ValueError("a parallel job needs a store its ranks can open by URL (kiln.store.open_store)")
    cache = getattr(store, "cache", None)  # an S3 store's local copies, which the ranks share
    with tempfile.TemporaryDirectory(prefix="kiln-launch-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "spec.json").write_text(spec.to_json())
        events, stop, log = tmp / "events.jsonl", tmp / "stop", tmp / "torchrun.log"
        events.touch()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={spec.parallel.nproc}",
            "-m",
            "engine.launch",
            str(tmp / "spec.json"),
            url,
            *(["--cache", str(cache)] if cache is not None else []),
            "--events",
            str(events),
            "--stop",
            str(stop),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
            "KILN_LAUNCHER_PID": str(os.getpid()),
        }
        end = None
        with log.open("w") as out, events.open() as feed:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            try:
                while True:
                    done = proc.poll() is not None
                    for line in feed.readlines():
                        end = _replay(line, reporter) or end
                    if done:
                        break
                    reason = reporter.should_stop()
                    if reason and not stop.exists():
                        stop.write_text(reason)
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
        if end is not None and end["kind"] == "error":
            raise _error(end)
        tail = log.read_text()[-4000:]
        if end is None:
            raise RuntimeError(f"the parallel run failed (exit code {proc.returncode}):\n{tail}")
        if proc.returncode != 0:  # rank 0 wrote the result after the adapter was stored: nothing is lost
            reporter.message(
                f"a rank failed after the run had finished (exit code {proc.returncode}); "
                "the results were stored before, so the job stands",
                level="warning",
                data={"log": tail},
            )
        return TrainResult(**end["result"])


def _error(e: dict) -> Exception:
    if e.get("issues") is not None:
        from kiln.dataset import DatasetError, Issue

        return DatasetError([Issue(**i) for i in e["issues"]])
    return {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(e["type"], RuntimeError)(e["message"])


def main(argv: list[str]) -> NoReturn:
    """One rank, under torchrun. ``run`` passes the events and stop files; by hand (a multi-node
    run) they are optional: without ``--events`` rank 0 prints its reports as JSON lines."""
    import argparse

    from engine.parallel.mesh import close_mesh, init_mesh
    from engine.trainer import train
    from kiln.store import open_store

    p = argparse.ArgumentParser(prog="torchrun ... -m engine.launch")
    p.add_argument("spec", type=Path, help="the job spec as JSON (python -m engine.cli spec job.yaml > spec.json)")
    p.add_argument(
        "store", help="the store: a folder (the same path on every node), file:///path or s3://bucket/prefix"
    )
    p.add_argument("--cache", type=Path, default=Path("kiln-data/store-cache"), help="an S3 store's local copies")
    p.add_argument("--events", type=Path, default=Path("/dev/stdout"))
    p.add_argument("--stop", type=Path, default=Path("stop"), help="write a reason here to stop at the next step")
    a = p.parse_args(argv)
    spec = JobSpec.from_json(a.spec.read_text())
    mesh = init_mesh(spec.parallel.ep_size, spec.parallel.cp_size)
    writer = FileReporter(a.events, a.stop) if mesh.rank == 0 else None  # rank 0 speaks
    reporter = writer or SilentReporter()
    try:
        result = train(spec, open_store(a.store, a.cache), reporter, mesh)
    except Exception as e:
        if writer is not None:
            issues = (
                [asdict(i) for i in e.issues] if hasattr(e, "issues") else None
            )  # a DatasetError's lines and fields
            writer._write("error", type=type(e).__name__, message=str(e), issues=issues)
        raise
    if writer is not None:
        writer._write("result", result=asdict(result))
    close_mesh()


if __name__ == "__main__":
    main(sys.argv[1:])
