"""The chunked linear + cross-entropy equals the full computation, loss and both gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln_kernels.loss import linear_cross_entropy


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "N,D,V,tc,vc,dtype,tol",
    [
        (37, 16, 101, 8, 32, torch.float64, 1e-12),  # ragged chunks on both axes
        (200, 32, 1000, 64, 128, torch.float64, 1e-12),
        (256, 64, 5000, 100, 777, torch.float32, 1e-5),
        (10, 8, 50, 4096, 16384, torch.float64, 1e-12),  # chunks larger than the data
    ],
)
def test_matches_full_cross_entropy(N, D, V, tc, vc, dtype, tol):
    g = torch.Generator().manual_seed(N)
    h = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100  # ignored tokens count for nothing
    ref = F.cross_entropy((h.double() @ W.double().t()), labels, ignore_index=-100)
    dh_ref, dW_ref = torch.autograd.grad(ref * 3.0, [h, W])
    got, _ = linear_cross_entropy(h, W, labels, token_chunk=tc, vocab_chunk=vc)
    dh, dW = torch.autograd.grad(got * 3.0, [h, W])
    assert got.dtype == dtype and abs(float(got.detach()) - float(ref)) / float(ref) < tol
    assert rel(dh.double(), dh_ref.double()) < tol and rel(dW.double(), dW_ref.double()) < tol


def test_all_ignored_gives_zero_not_nan():
    h = torch.randn(4, 8, requires_grad=True)
    W = torch.randn(20, 8, requires_grad=True)
    loss, right = linear_cross_entropy(h, W, torch.full((4,), -100))
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(h.grad) == 0 and torch.isfinite(W.grad).all()
    assert int(right) == 0


@pytest.mark.parametrize("vc", [7, 16384])
def test_counts_the_argmax_hits_the_first_index_winning_ties(vc):
    """``right`` is what (h W^T).argmax(-1) == y counts over the targets, across vocabulary chunks,
    with exact ties between rows of W in different chunks going to the first."""
    g = torch.Generator().manual_seed(vc)
    # small integers: every product exact, whatever the chunking, so the ties are exact
    h = torch.randint(-3, 4, (64, 8), generator=g).double()
    W = torch.randint(-3, 4, (30, 8), generator=g).double()
    W[20] = W[3]  # a tie in every row's logits between columns 3 and 20
    logits = h @ W.t()
    y = logits.argmax(-1)
    y[::3] = torch.randint(0, 30, (22,), generator=g)  # some wrong
    y[1::7] = 20  # the tie's second column: never the argmax
    y[::5] = -100
    _, right = linear_cross_entropy(h, W, y, token_chunk=10, vocab_chunk=vc)
    want = ((logits.argmax(-1) == y) & (y != -100)).sum()
    assert right.dtype == torch.long and int(right) == int(want) and 0 < int(want) < 64
