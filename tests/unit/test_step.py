"""engine.training.step launches a part's backward before it reads anything the forward computed
on the device: on a GPU such a read waits for the whole forward, and the device then idles while
the host launches the backward's first kernels. The target count comes from the batch as it was
made; the loss and the argmax hits stay on the device, read by the caller once the update is
queued (engine.training.optim)."""

from __future__ import annotations

import torch
from torch import nn

from engine.data import Sample
from engine.training import step
from engine.training.ranks import Single


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
