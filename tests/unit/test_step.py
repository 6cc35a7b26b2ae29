"""engine.training.step launches a part's backward before it reads anything the forward computed
on the device: on a GPU such a read waits for the whole forward, and the device then idles while
the host launches the backward's first kernels. The target count comes from the batch as it was
made; the loss and the argmax hits stay on the device, read by the caller once the update is
queued; a fused optimizer skips a non-finite update on the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.data import Sample
from engine.training import step
from engine.training.ranks import Single

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Hits(torch.Tensor):
    """The forward's argmax count: records when it is read."""

    events: list[str] = []

    def __int__(self) -> int:
        Hits.events.append("hits read")
        return int(self.as_subclass(torch.Tensor))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def forward(self, ids, pixels, docs, positions, labels_BT, past):
        loss = self.w * ids.float().mean()
        loss.register_hook(lambda g: Hits.events.append("backward"))
        return loss, torch.tensor(3).as_subclass(Hits)


def test_the_backward_is_launched_before_the_forwards_results_are_read():
    Hits.events = []
    docs = [torch.arange(3, 13), torch.arange(5, 9)]
    samples = [Sample(i, d, d.clone(), torch.zeros(0, 3, 1, 1)) for i, d in enumerate(docs)]
    model = Model()
    loss, targets, right, tokens, rows = step.accumulate(model, samples, 1, 0, 16, Single(torch.device("cpu")))
    assert Hits.events == ["backward"]  # nothing read: the caller reads after queueing the update
    assert (targets, int(right), tokens) == (13, 3, 14)  # one packed row: its tokens after the first
    assert Hits.events == ["backward", "hits read"]
    assert model.w.grad is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_fused_update_skips_a_non_finite_gradient_on_the_device(device):
    w = nn.Parameter(torch.ones(3, device=device))
    opt = step.optimizer([w], 0.1)
    assert opt.defaults["fused"]
    ranks = Single(torch.device(device))
    w.grad = torch.tensor([1.0, float("nan"), 0.0], device=device)
    norm, finite = step.update(opt, [w], ranks)
    assert not finite and torch.isnan(norm)
    assert torch.equal(w.detach().cpu(), torch.ones(3))  # not moved, and Adam's step count not advanced
    assert float(opt.state[w]["step"]) == 0
    w.grad = torch.tensor([3.0, 4.0, 0.0], device=device)  # norm 5: clipped to 1
    norm, finite = step.update(opt, [w], ranks)
    assert finite and float(norm) == 5.0
    assert float(opt.state[w]["step"]) == 1
    assert torch.allclose(w.detach().cpu(), torch.tensor([0.9, 0.9, 1.0]))  # Adam's first step: lr x sign
