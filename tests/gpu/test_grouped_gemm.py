"""The Triton grouped GEMM (kiln_kernels/experimental/grouped_gemm.py, not used by the engine)
against float64 references on fresh random inputs: output, the rows' and the weights' gradients
with empty groups, one-row groups and odd widths, each way of loading and storing its tiles; its
row-tile table; and, on CUDA, the experts with LoRA through it in bf16 against the float64 loop.
On a CPU these run through Triton's interpreter in fp32 (tests/unit/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels.moe import reference
from tests.interpret import DEVICE, gpu_only, needs_kernels
from tests.tolerance import rel

pytestmark = needs_kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def counts_for(E: int, seed: int, most: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    c = torch.randint(0, most, (E,), device=DEVICE, generator=g)
    c[0], c[1], c[-1] = 0, most - 1, 1  # an empty group, a large one (whole row tiles), a one-row group
    return c


# how the TMA kernels load and store: rows (y and dx), weights (dW)
LOADS = {
    "pointers": ({}, {}),
    "tma": ({"TMA": True}, {"TMA": True}),
    "tma, flat, tma stores": ({"TMA": True, "FLAT": 1, "STORE": 2}, {"TMA": True, "FLAT": 1}),
    "tma, warp-specialised": ({"TMA": True, "WS": 1, "STORE": 1}, {"TMA": True, "WS": 1}),
}


@pytest.mark.parametrize("loads", list(LOADS))
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu_only)])
@pytest.mark.parametrize(
    "E,N,K,most",
    [(5, 24, 40, 70), (3, 136, 72, 200), (4, 128, 40, 150), pytest.param(16, 1024, 2048, 700, marks=gpu_only)],
)
def test_grouped_gemm_matches_the_loop(E, N, K, most, dtype, loads, monkeypatch):
    """Each way of loading and storing the TMA kernels' tiles (the rows kernel takes dx only where
    the reduction N is whole BK blocks: the 128 and 1024 cases)."""
    from kiln_kernels.experimental import grouped_gemm as fast
    from kiln_kernels.experimental.grouped_gemm import gmm

    keys = ("TMA", "WS", "FLAT", "STORE")
    for which, opts in zip(("rows", "weights"), LOADS[loads], strict=True):
        cfg = {key: value for key, value in fast.CONFIG[which].items() if key not in keys}
        monkeypatch.setitem(fast.CONFIG, which, {**cfg, **opts})
    launches = []

    class Counted:  # which GEMMs the TMA kernels ran
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append({True: "dx", False: "y"}.get(kw.get("TRANS"), self.name))
                return self.kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(fast, "_gmm_rows_tma", Counted(fast._gmm_rows_tma, "y"))
    monkeypatch.setattr(fast, "_gmm_weights_tma", Counted(fast._gmm_weights_tma, "dW"))

    counts = counts_for(E, E * N, most)
    offs = counts.cumsum(0).to(torch.int32)
    g = torch.Generator(device=DEVICE).manual_seed(K)
    x = torch.randn(int(counts.sum()), K, device=DEVICE, generator=g).to(dtype).requires_grad_()
    W = (torch.randn(E, N, K, device=DEVICE, generator=g) * K**-0.5).to(dtype).requires_grad_()
    dy = torch.randn(x.shape[0], N, device=DEVICE, generator=g).to(dtype)
    y = gmm(x, W, offs)
    y.backward(dy)
    x64, W64 = x.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    want = torch.cat([rows @ W64[e].T for e, rows in enumerate(x64.split(counts.tolist()))])
    want.backward(dy.double())
    assert y.dtype == dtype and y.shape == want.shape
    tol = TOL[dtype]
    assert rel(y, want) < tol and rel(x.grad, x64.grad) < tol and rel(W.grad, W64.grad) < tol
    assert (W.grad[0] == 0).all()  # the empty group's weights get no gradient
    assert set(launches) == (set() if loads == "pointers" else {"y", "dx", "dW"} if N in (128, 1024) else {"y", "dW"})


def check_row_tiles(counts: torch.Tensor, BM: int) -> list[int]:
    """The table's invariants; its bounds."""
    from kiln_kernels.experimental.grouped_gemm import _tiles

    offs = counts.cumsum(0).to(torch.int32)
    starts = offs - counts
    M = int(counts.sum())
    e, row, n, bounds = _tiles(offs, M, BM)
    assert n == -(-M // BM) + len(counts)
    covered = torch.zeros(M, dtype=torch.int32)
    for t, (g, r) in enumerate(zip(e.tolist(), row.tolist(), strict=True)):
        if t >= bounds[2]:
            assert g == -1
            continue
        if t < bounds[1]:
            assert counts[g] >= BM and starts[g] <= r and r + BM <= offs[g]
        else:
            assert 0 < counts[g] < BM and r == starts[g]
        covered[r : min(r + BM, int(offs[g]))] += 1
    assert (covered >= 1).all()
    assert int((covered > 1).sum()) == sum(-int(c) % BM for c in counts if c >= BM)  # only the last tiles overlap
    return bounds.tolist()


def test_row_tiles_lie_inside_their_groups():
    """TMA stores write whole row tiles: each tile of a group of at least BM rows lies inside it
    (the last one overlapping the one before), together they cover it, and they come first; each
    smaller group gets one tile after them (stored masked); the rest are unused. The table is
    built by a kernel in blocks of tiles: here in one block and in many."""
    counts = torch.tensor([0, 16, 40, 5, 1, 33, 0, 17], device=DEVICE)
    assert check_row_tiles(counts, 16) == [0, 1 + 3 + 3 + 2, 1 + 3 + 3 + 2 + 2]
    g = torch.Generator(device=DEVICE).manual_seed(5)
    check_row_tiles(torch.randint(0, 300, (300,), device=DEVICE, generator=g), 128)


@gpu_only
@pytest.mark.parametrize("E,D,I,r", [(8, 64, 32, 8), (13, 256, 96, 16)])
def test_experts_with_lora_match_the_loop(E, D, I, r):
    from kiln_kernels.experimental import grouped_gemm as fast
    from tests.gpu.test_moe_cuda import case, leaves, situ

    x, counts, W1, W2, lora, w = case(E, D, I, r, E + D + 1)
    dy = torch.randn(x.shape[0], D, device="cuda")
    y = fast.grouped_mlp(x, counts, W1, W2, situ, lora, 2.0, w)
    y.float().backward(dy)
    d = [p.detach().double().requires_grad_() for p in leaves(x, W1, W2, lora, w)]
    want = reference.grouped_mlp(
        d[0], counts, d[1], d[2], situ, {"gate_up_proj": (d[3], d[4]), "down_proj": (d[5], d[6])}, 2.0, d[7]
    )
    want.backward(dy.double())
    assert y.dtype == torch.bfloat16 and rel(y, want) < 1e-2
    for i, (p, q) in enumerate(zip(leaves(x, W1, W2, lora, w), d, strict=True)):
        assert rel(p.grad, q.grad) < 1e-2, i
