"""The Triton linear + cross-entropy against the float64 definition on fresh random inputs:
the loss and both gradients, ragged shapes, ignored targets, bf16 and fp32 (tolerances of
ARCHITECTURE.md: relative Frobenius error fp32 < 1e-5, bf16 < 1e-2). On a CPU the fp32 cases run
through Triton's interpreter (tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def definition(h, W, y):
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ W64.t(), y, ignore_index=-100)
    (loss * 2.5).backward()
    return loss, h64.grad, W64.grad


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "N,D,V",
    [pytest.param(777, 96, 5003, marks=gpu_only), pytest.param(2048, 256, 32000, marks=gpu_only), (33, 64, 131)],
)
def test_matches_the_definition(N, D, V, dtype):
    from kiln_kernels.loss.triton import linear_cross_entropy

    g = torch.Generator(device=DEVICE).manual_seed(N + V)
    h = (torch.randn(N, D, device=DEVICE, generator=g) * 0.5).to(dtype).requires_grad_()
    W = (torch.randn(V, D, device=DEVICE, generator=g) * 0.2).to(dtype).requires_grad_()
    y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    y[torch.rand(N, device=DEVICE, generator=g) < 0.25] = -100
    loss, right = linear_cross_entropy(h, W, y)
    (loss * 2.5).backward()
    want, dh, dW = definition(h, W, y)
    hits = (((h.detach() @ W.detach().t()).argmax(-1) == y) & (y != -100)).sum()
    assert right.dtype == torch.long and abs(int(right) - int(hits)) <= N // 200  # bf16 near-ties may differ
    assert abs(float(loss.detach()) - float(want)) / float(want) < TOL[dtype]
    assert h.grad.dtype == dtype and W.grad.dtype == dtype
    assert rel(h.grad, dh) < TOL[dtype] and rel(W.grad, dW) < TOL[dtype]


def test_small_chunks_and_all_ignored(monkeypatch):
    from kiln_kernels.loss import triton as impl

    monkeypatch.setattr(impl, "CHUNK_BYTES", 64 * 1000 * 4)  # at most 64 rows a chunk: four of 64, one of 44
    assert impl._chunk(300, 1000, 4) == 64
    h = torch.randn(300, 32, device=DEVICE, requires_grad=True)
    W = torch.randn(1000, 32, device=DEVICE, requires_grad=True)
    y = torch.randint(0, 1000, (300,), device=DEVICE)
    impl.linear_cross_entropy(h, W, y)[0].mul(2.5).backward()
    want, dh, dW = definition(h, W, y)
    assert rel(h.grad, dh) < 1e-5 and rel(W.grad, dW) < 1e-5
    again, _ = impl.linear_cross_entropy(h, W, y)
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        again.backward()
    none = torch.full((300,), -100, device=DEVICE)
    h.grad = W.grad = None
    loss, _ = impl.linear_cross_entropy(h, W, none)
    loss.backward()
    assert float(loss) == 0 and not h.grad.any() and not W.grad.any()


def test_chunks_of_a_long_row_start_aligned_as_the_first():
    """Several chunks: a multiple of ROWS rows each (whole GEMM tiles; each chunk's slices of the
    labels, losses and hits start 16-byte aligned: one specialisation of the row kernel), within
    CHUNK_BYTES, no more chunks than that allows."""
    from kiln_kernels.loss import triton as impl

    V = 163840
    most = impl.CHUNK_BYTES // (V * 2)
    for N in (16384, 16384 + 37, 131072, 131072 + 1, 1_000_000):
        C = impl._chunk(N, V, 2)
        chunks = -(-N // C)
        assert C % impl.ROWS == 0 and C <= most and N - (chunks - 1) * C > 0
        assert chunks == -(-N // (most // impl.ROWS * impl.ROWS))  # no more chunks than the most rows allow
    assert impl._chunk(1000, V, 2) == 1000  # one chunk: as it is


def test_the_forward_reads_nothing_back_from_the_device(monkeypatch):
    """No value of the forward's is read on the host (``aten._local_scalar_dense``: what
    ``int()``, ``item()`` and ``bool()`` of a tensor run): on a GPU such a read waits for the whole
    forward before the loss's GEMMs and the backward are launched. The target count stays a tensor.
    The kernel's launches run outside the watch (the interpreter reads its own arguments)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from kiln_kernels.loss import triton as impl

    kernel = impl._ce_rows

    class Unwatched:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                with _disable_current_modes():
                    return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(impl, "_ce_rows", Unwatched())
    linear_cross_entropy = impl.linear_cross_entropy

    class Reads(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    h = torch.randn(6, 32, device=DEVICE, requires_grad=True)  # few rows: triton-ascend's interpreter takes ~3 s a row
    W = torch.randn(300, 32, device=DEVICE, requires_grad=True)
    y = torch.randint(0, 300, (6,), device=DEVICE)
    y[::3] = -100
    with Reads():
        loss, right = linear_cross_entropy(h, W, y)
    assert Reads.seen == []
    (loss * 2.5).backward()
    want, dh, _ = definition(h, W, y)  # and the count it divides by is the right one
    assert abs(float(loss.detach()) - float(want)) / float(want) < 1e-5 and rel(h.grad, dh) < 1e-5


@gpu_only
def test_dispatch_picks_triton_on_cuda_and_reference_when_forced(monkeypatch):
    import kiln_kernels.loss as loss

    h = torch.randn(64, 32, device=DEVICE)
    W = torch.randn(500, 32, device=DEVICE)
    y = torch.randint(0, 500, (64,), device=DEVICE)
    fast = loss.linear_cross_entropy(h, W, y)[0]
    monkeypatch.setenv("KILN_KERNELS", "reference")
    ref = loss.linear_cross_entropy(h, W, y)[0]
    assert torch.allclose(fast, ref, rtol=1e-5)
    from kiln_kernels.dispatch import fast as use_fast

    assert not use_fast(h)
    monkeypatch.setenv("KILN_KERNELS", "auto")
    assert use_fast(h) and not use_fast(h.cpu())  # (on CUDA)
