"""engine.training.optim: a fused AdamW skips a non-finite step on the device (weights, moments
and step count untouched), clips a finite one; a checkpoint written by either form of the
optimizer resumes in the fused one, its step counts where the fused kernel reads them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.training import optim
from engine.training.ranks import Single

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_fused_update_skips_a_non_finite_gradient_on_the_device(device):
    w = nn.Parameter(torch.ones(3, device=device))
    opt = optim.optimizer([w], 0.1)
    assert optim.fused(opt)
    ranks = Single(torch.device(device))
    w.grad = torch.tensor([1.0, float("nan"), 0.0], device=device)
    norm, finite = optim.update(opt, [w], ranks)
    assert not finite and torch.isnan(norm)
    assert torch.equal(w.detach().cpu(), torch.ones(3))  # not moved, and Adam's step count not advanced
    assert float(opt.state[w]["step"]) == 0
    assert not hasattr(opt, "found_inf")  # a step taken elsewhere later is not skipped by this one's verdict
    w.grad = torch.tensor([3.0, 4.0, 0.0], device=device)  # norm 5: clipped to 1
    norm, finite = optim.update(opt, [w], ranks)
    assert finite and float(norm) == 5.0
    assert float(opt.state[w]["step"]) == 1
    assert torch.allclose(w.detach().cpu(), torch.tensor([0.9, 0.9, 1.0]))  # Adam's first step: lr x sign


def steps(opt, w, grads):
    for g in grads:
        w.grad = g.clone()
        optim.update(opt, [w], Single(w.device))
    return w.detach().clone()


@pytest.mark.parametrize("writer_fused", [False, True])
def test_a_checkpoint_of_either_optimizer_resumes_in_the_fused_one(writer_fused):
    grads = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    w = nn.Parameter(torch.ones(4))
    writer = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0, fused=writer_fused or None)
    steps(writer, w, grads[:2])
    saved = writer.state_dict()
    # the same run straight through, fused
    w_all = nn.Parameter(torch.ones(4))
    want = steps(optim.optimizer([w_all], 0.1), w_all, grads)
    w2 = nn.Parameter(w.detach().clone())
    opt = optim.optimizer([w2], 0.1)
    opt.load_state_dict(saved)
    optim.restored(opt)
    assert optim.fused(opt) and opt.state[w2]["step"].dtype == torch.float32
    got = steps(opt, w2, grads[2:])
    assert float(opt.state[w2]["step"]) == 4
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
