"""On one GPU (skipped elsewhere): the parallel code paths on CUDA with NCCL, world size 1 (one
GPU is what is lent here): FSDP2's step equals the plain model's within bf16 tolerance, a DCP
checkpoint written on the GPU loads back exactly, and a job started by torchrun trains as
engine.train does in one process."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.reporting import RecordingReporter
from kiln.store import LocalStore
from tests.parallel_worker import ROWS, build, n_targets, step_loss
from tests.tolerance import rel
from tests.unit.test_parallel import job, launch, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def deterministic(monkeypatch):
    """Both runs without atomics: bf16 sums in another order move near-tied experts' routing, and
    one flipped token changes the gradients by percents."""
    monkeypatch.setenv("KILN_DETERMINISTIC", "1")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_fsdp_step_and_dcp_on_cuda(tmp_path, deterministic):
    torchrun(1, "--mode", "full", "--out", str(tmp_path / "step.pt"), "--save", str(tmp_path / "ckpt"))
    got = torch.load(tmp_path / "step.pt")
    model, data = build("full")
    model.cuda()
    loss = step_loss(model, data, list(range(ROWS)), n_targets(data), torch.device("cuda"))
    loss.backward()
    assert got["loss"] == pytest.approx(float(loss.detach()), rel=1e-2)
    for n, p in model.named_parameters():
        assert rel(got["grads"][n], p.grad.cpu()) < 1e-2, n
    torchrun(1, "--mode", "full", "--out", str(tmp_path / "loaded.pt"), "--load", str(tmp_path / "ckpt"))
    loaded = torch.load(tmp_path / "loaded.pt")
    for part in ("params", "exp_avg"):
        for n, t in got[part].items():
            assert torch.equal(loaded[part][n], t), (part, n)


def test_a_job_under_torchrun_on_cuda_trains_as_one_process(tmp_path):
    spec = job(max_steps=4, validation_file=None)
    one = RecordingReporter()
    engine.train(spec, LocalStore(tmp_path / "one"), one)
    (tmp_path / "spec.json").write_text(spec.to_json())
    events = launch(1, tmp_path / "spec.json", tmp_path / "two", tmp_path / "events.jsonl")
    assert any("Parallel: 1 processes" in e.get("text", "") for e in events)
    losses = {e["step"]: e["values"]["train_loss"] for e in events if e["kind"] == "metrics"}
    assert losses == pytest.approx(one.losses, rel=1e-2)
    assert events[-1]["kind"] == "result" and events[-1]["result"]["status"] == "succeeded"
    assert (tmp_path / "two" / "artifacts" / "jobs" / spec.job_id / "checkpoints" / "step-0000004" / "dcp").is_dir()
