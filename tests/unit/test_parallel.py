"""FSDP2 + expert parallel on the CPU (gloo), launched by torchrun as a real run is: the sharded
step's loss and gradients equal one process computing the same step; a DCP checkpoint written
on one layout loads on another (world size and EP size both change); a whole job through
``engine.train`` on two processes trains as one process does, stops when asked, and resumes
on one process from its sharded checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

import engine
from engine.reporting import RecordingReporter
from kiln.dataset import DatasetError
from kiln.spec import JobSpec, LoraSpec, MemorySpec, ParallelSpec
from kiln.store import LocalStore
from tests.conftest import running, wait_for
from tests.parallel_worker import ROWS, build, n_targets, step_loss
from tests.tolerance import rel

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def torchrun(n: int, *args: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        "tests.parallel_worker",
        *args,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.parametrize("mode,world,ep", [("lora", 2, 2), ("full", 2, 1), ("full", 4, 2), ("lora", 4, 4)])
def test_sharded_step_equals_one_process(tmp_path, mode, world, ep):
    out = tmp_path / "out.pt"
    torchrun(world, "--mode", mode, "--ep", str(ep), "--out", str(out))
    got = torch.load(out)
    model, data = build(mode)  # one process, the same rows per part, the same normalisation
    expect = 0.0
    for r in range(world):
        loss = step_loss(model, data, list(range(r, ROWS, world)), n_targets(data), torch.device("cpu"))
        loss.backward()
        expect += float(loss.detach())
    assert got["loss"] == pytest.approx(expect, rel=1e-6)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(got["grads"]) == set(trained)
    assert any("experts" in n for n in trained)
    for n, p in trained.items():
        assert p.grad is not None and p.grad.norm() > 0, n
        assert tuple(got["grads"][n].shape) == tuple(p.shape), n  # whole tensors: all experts
        assert rel(got["grads"][n], p.grad) < 1e-5, (n, rel(got["grads"][n], p.grad))


def test_dcp_checkpoint_loads_on_other_world_and_ep_sizes(tmp_path):
    saved = tmp_path / "saved.pt"
    torchrun(2, "--mode", "lora", "--ep", "2", "--out", str(saved), "--save", str(tmp_path / "ckpt"))
    want = torch.load(saved)
    assert want["exp_avg"] and any(v.abs().sum() > 0 for v in want["exp_avg"].values())
    for world, ep in ((4, 4), (1, 1)):
        loaded = tmp_path / f"loaded-{world}-{ep}.pt"
        torchrun(world, "--mode", "lora", "--ep", str(ep), "--out", str(loaded), "--load", str(tmp_path / "ckpt"))
        got = torch.load(loaded)
        for part in ("params", "exp_avg"):
            assert set(got[part]) == set(want[part])
            for n in want[part]:
                assert torch.equal(got[part][n], want[part][n]), (world, ep, part, n)


SAMPLE = ROOT / "data" / "sample"


def job(**kw) -> JobSpec:
    base = dict(
        job_id="ftjob-par",
        model="kiln-hybrid-tiny",
        training_file=str(SAMPLE / "train.jsonl"),
        validation_file=str(SAMPLE / "validation.jsonl"),
        images_file=str(SAMPLE / "images.zip"),
        n_epochs=1,
        batch_size=4,
        seed=3,
        max_steps=4,
        checkpoint_interval=2,
        lora=LoraSpec(rank=4, alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    )
    return JobSpec(**{**base, **kw})


def adapter(store: LocalStore, key: str) -> dict[str, torch.Tensor]:
    with zipfile.ZipFile(store.path(key)) as zf:
        return load(zf.read("adapter_model.safetensors"))


def test_a_job_on_two_processes_trains_as_one_and_resumes_on_one(tmp_path):
    one, two = RecordingReporter(), RecordingReporter()
    first = engine.train(job(), LocalStore(tmp_path / "one"), one)
    store = LocalStore(tmp_path / "two")
    # Swap Core's recompute inside FSDP2 units too, keeping the matmuls (the kernels run on a GPU only)
    swap = MemorySpec(recompute="selective", tier="host", cache_ops=["mm", "grouped_mm"])
    second = engine.train(job(parallel=ParallelSpec(nproc=2, ep_size=2), memory=swap), store, two)
    assert (
        second.status == "succeeded" and "Parallel: 2 processes, FSDP2 over all, experts split 2 ways" in two.messages
    )
    assert two.steps[4]["swap_host_mb"] > 0
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    assert two.steps[4]["valid_loss"] == pytest.approx(one.steps[4]["valid_loss"], rel=1e-5)
    assert two.steps[4]["trained_tokens"] == one.steps[4]["trained_tokens"]
    a, b = adapter(LocalStore(tmp_path / "one"), first.adapter_key), adapter(store, second.adapter_key)
    assert set(a) == set(b) and any("experts" in k for k in a)
    for k in a:  # the gathered adapter has every expert, in PEFT's layout
        assert a[k].shape == b[k].shape and rel(b[k], a[k]) < 1e-4, k

    # stopped on two processes after step 2 (checkpoint at 2), resumed on one from the sharded checkpoint
    store = LocalStore(tmp_path / "three")
    stopped = engine.train(job(parallel=ParallelSpec(nproc=2, ep_size=2)), store, RecordingReporter(stop_after=2))
    assert stopped.status == "stopped" and stopped.stop_reason == "cancel"
    ckpt = store.path("jobs/ftjob-par/checkpoints/step-0000002")
    assert (ckpt / "dcp").is_dir() and (ckpt / "adapter_model.safetensors").exists()
    resumed = RecordingReporter()
    engine.train(job(resume_from="jobs/ftjob-par/checkpoints/step-0000002"), store, resumed)
    assert sorted(resumed.losses) == [3, 4]
    assert resumed.losses == pytest.approx({s: one.losses[s] for s in (3, 4)}, rel=1e-5)


def test_fewer_examples_than_processes(tmp_path):
    """Batch size 1 on two processes: rank 1 has nothing to train on; it runs a stand-in weighted
    0, so the collectives stay in step and the update is the one-process update."""
    one, two = RecordingReporter(), RecordingReporter()
    engine.train(job(batch_size=1, max_steps=3, validation_file=None), LocalStore(tmp_path / "a"), one)
    engine.train(
        job(batch_size=1, max_steps=3, validation_file=None, parallel=ParallelSpec(nproc=2, ep_size=2)),
        LocalStore(tmp_path / "b"),
        two,
    )
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    assert [two.steps[s]["rows"] for s in (1, 2, 3)] == [one.steps[s]["rows"] for s in (1, 2, 3)]


def test_full_training_on_two_processes_saves_the_whole_model(tmp_path):
    """Every parameter trains (routers rebalance on the summed loads); rank 0 saves the gathered
    model in the family's format, and it equals the one-process run's. Kimi Linear: the hybrid's
    DSA indexer loss is averaged per forward, so it depends on how a step is split (README)."""
    from engine.model.registry import load_base

    text = "\n".join(l for l in (SAMPLE / "train.jsonl").read_text().splitlines() if '"images"' not in l)
    (tmp_path / "text.jsonl").write_text(text + "\n")
    spec = dict(
        model="kimi-linear-tiny",
        training="full",
        max_steps=3,
        validation_file=None,
        images_file=None,
        training_file=str(tmp_path / "text.jsonl"),
        moe_bias_rate=0.1,
    )
    one, two = RecordingReporter(), RecordingReporter()
    a = engine.train(job(**spec), LocalStore(tmp_path / "a"), one)
    b = engine.train(job(**spec, parallel=ParallelSpec(nproc=2, ep_size=2)), LocalStore(tmp_path / "b"), two)
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    assert [two.steps[s]["grad_norm"] for s in (1, 2, 3)] == pytest.approx(
        [one.steps[s]["grad_norm"] for s in (1, 2, 3)], rel=1e-5
    )
    ma = load_base(LocalStore(tmp_path / "a").path(a.adapter_key))
    mb = load_base(LocalStore(tmp_path / "b").path(b.adapter_key))
    base = load_base(LocalStore(tmp_path / "a").model_dir("kimi-linear-tiny"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(ma.get_buffer(bias), base.get_buffer(bias))  # the routers did rebalance
    assert torch.equal(ma.get_buffer(bias), mb.get_buffer(bias))
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters(), strict=True):
        assert rel(q.detach(), p.detach()) < 1e-4, n


def test_a_bad_dataset_on_two_processes_names_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "wizard", "content": "x"}]}\n'
    )
    with pytest.raises(DatasetError) as e:
        engine.train(
            job(training_file=str(bad), validation_file=None, parallel=ParallelSpec(nproc=2)),
            LocalStore(tmp_path / "s"),
            RecordingReporter(),
        )
    assert e.value.issues and e.value.issues[0].line == 2 and "role" in e.value.issues[0].field


def launch(n: int, spec: Path, store: Path, events: Path) -> list[dict]:
    """README's multi-node command on this node (c10d rendezvous); rank 0's reports."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={n}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        "-m",
        "engine.launch",
        str(spec),
        str(store),
        "--events",
        str(events),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in events.read_text().splitlines()]


def test_the_multi_node_command_runs_a_job(tmp_path):
    """README's multi-node recipe, on one node: the spec from a YAML, torchrun with a c10d
    rendezvous (as every node of a multi-node run starts it), reports as JSON lines."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        f"model: kiln-hybrid-tiny\ntraining_file: {SAMPLE / 'train.jsonl'}\nimages_file: {SAMPLE / 'images.zip'}\n"
        "max_steps: 2\nbatch_size: 4\nparallel: {nproc: 2, ep_size: 2}\n"
    )
    spec = subprocess.run(
        [sys.executable, "-m", "engine.cli", "spec", str(cfg)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert JobSpec.from_json(spec).parallel == ParallelSpec(nproc=2, ep_size=2)
    (tmp_path / "spec.json").write_text(spec)
    events = launch(2, tmp_path / "spec.json", tmp_path / "store", tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "metrics"] == [1, 2]
    assert events[-1]["kind"] == "result" and events[-1]["result"]["status"] == "succeeded"
    assert (tmp_path / "store" / "artifacts" / events[-1]["result"]["adapter_key"]).exists()


def test_a_rank_failing_after_the_result_loses_no_job(tmp_path, monkeypatch):
    """A rank that aborts in its teardown (gloo has, once in a CI run) after rank 0 reported the
    result: torchrun exits 1, but the adapter is stored, so the job succeeds, with a warning."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('LOCAL_RANK') == '1':\n    import torch.distributed as dist\n"
        "    dist.destroy_process_group = lambda *a, **k: os.abort()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(hook))
    reporter, store = RecordingReporter(), LocalStore(tmp_path / "store")
    result = engine.train(
        job(max_steps=2, validation_file=None, parallel=ParallelSpec(nproc=2, ep_size=2)), store, reporter
    )
    assert result.status == "succeeded" and store.path(result.adapter_key).exists()
    assert any("a rank failed after the run had finished (exit code 1)" in m for m in reporter.messages), (
        reporter.messages
    )


def test_a_killed_launcher_leaves_no_run_behind(tmp_path):
    """kill -9 of the process that called engine.train (a worker dying mid-job): the ranks stop
    by themselves, so the job's resumption elsewhere is the only run."""
    import signal

    (tmp_path / "spec.json").write_text(
        job(
            n_epochs=20,
            batch_size=1,
            max_steps=None,
            checkpoint_interval=10**6,
            validation_file=None,
            parallel=ParallelSpec(nproc=2, ep_size=2),
        ).to_json()
    )
    code = (
        "import sys, engine; from kiln.spec import JobSpec; from kiln.store import LocalStore; "
        "from engine.reporting import RecordingReporter\n"
        "class R(RecordingReporter):\n    def metrics(self, step, values): print('step', step, flush=True)\n"
        f"engine.train(JobSpec.from_json(open({str(tmp_path / 'spec.json')!r}).read()), "
        f"LocalStore({str(tmp_path / 'store')!r}), R())"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("step")  # training under torchrun
    ranks = subprocess.run(["pgrep", "-f", "engine.launch"], capture_output=True, text=True).stdout.split()
    assert ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the job would train for minutes more
    wait_for(lambda: not any(running(int(p)) for p in ranks), 20, 0.5, f"ranks {ranks} to end")
