"""The experts on CUDA through torch._grouped_mm (torch >= 2.8, Hopper): one grouped GEMM per
projection for all experts, no loop and no host sync (the group offsets stay on the device).
LoRA factors go through grouped GEMMs too. bf16 (the weights are cast as autocast casts them).
Same signature as the reference; ``usable`` says when it applies (bf16 or bf16 autocast, and
row lengths of 16 bytes: every width and the LoRA rank a multiple of 8).

With frozen expert weights (LoRA) both projections are one autograd Function, ``_Experts``: the
same grouped GEMMs, sums and activation as autograd's composition (``mlp``), but its output, the
gate/up product and the LoRA's rank-r products go through ``kiln_kernels.dispatch.kept`` as "experts":
Swap Core can keep them (``cache_ops: experts``) and the recompute then runs no grouped GEMM. It
saves the gate/up product, not the activation: the backward recomputes that (elementwise). SwiGLU
runs fused on CUDA, one Triton pass each way (``kiln_kernels.moe.triton.swiglu_rows``: its
backward recomputes the activation only when the down projection's LoRA needs it); another
activation (K3's SiTU), or SwiGLU where dispatch picks the reference, as autograd composes it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln_kernels.dispatch import OPS, choice, kept
from kiln_kernels.moe.reference import Lora, swiglu, weigh


def fused(act: Callable, t: torch.Tensor) -> bool:
    """Whether ``act`` runs as the fused SwiGLU kernel on ``t``'s device (dispatch's choice)."""
    return act is swiglu and choice("swiglu", t) == OPS["swiglu"].cuda


def activate(gu_M2I: torch.Tensor, act: Callable, w_M: torch.Tensor | None) -> torch.Tensor:
    """``act`` on the gate/up product's halves, weighed by ``w_M``: SwiGLU by the fused kernel on CUDA."""
    if fused(act, gu_M2I):
        from kiln_kernels.moe import triton as kernels  # triton: CUDA machines only

        return kernels.swiglu_rows(gu_M2I, w_M)
    return weigh(act(*gu_M2I.chunk(2, -1)), w_M)


def usable(x_MD: torch.Tensor, gate_up_E2ID: torch.Tensor, down_EDI: torch.Tensor, lora: Lora | None) -> bool:
    if not (x_MD.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if not (
        x_MD.dtype == torch.bfloat16
        or torch.is_autocast_enabled("cuda")
        and torch.get_autocast_dtype("cuda") == torch.bfloat16
    ):
        return False
    dims = [*gate_up_E2ID.shape[1:], *down_EDI.shape[1:]] + [A.shape[1] for A, _ in (lora or {}).values()]
    return all(d % 8 == 0 for d in dims)


def gmm(x_MK: torch.Tensor, W_ENK: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group e times W_e^T: [M, K] x [E, N, K] -> [M, N]."""
    return torch._grouped_mm(x_MK, W_ENK.to(torch.bfloat16).transpose(-2, -1), offs=offs)


def mlp(
    gmm: Callable,
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
    offs_dtype: torch.dtype = torch.int32,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts through a grouped GEMM ``gmm`` (torch's here; kiln_kernels/experimental/grouped_gemm.py
    passes its Triton one, kiln_kernels/moe/npu.py torch_npu's), in ``dtype``; ``gmm`` gets the
    groups' cumulative ends in ``offs_dtype``."""
    lora = lora or {}
    offs = counts_E.cumsum(0).to(offs_dtype)
    with torch.autocast(x_MD.device.type, enabled=False):
        x = x_MD.to(dtype)

        def proj(name: str, W: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            y = gmm(h, W, offs)
            if name in lora:
                A, B = lora[name]
                y = y + gmm(gmm(h, A, offs) * scaling, B, offs)  # scaled at rank r: M x r, not M x N
            return y

        h = activate(proj("gate_up_proj", gate_up_E2ID, x), act, w_M)
        return proj("down_proj", down_EDI, h)  # bf16, as F.linear under autocast gives


def grouped_mlp(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    act: Callable,
    lora: Lora | None = None,
    scaling: float = 1.0,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    if gate_up_E2ID.requires_grad or down_EDI.requires_grad:  # the experts trained whole: autograd's path
        return mlp(gmm, x_MD, counts_E, gate_up_E2ID, down_EDI, act, lora, scaling, w_M=w_M)
    lora = lora or {}
    offs = counts_E.cumsum(0).to(torch.int32)
    (A1, B1), (A2, B2) = (lora.get(name, (None, None)) for name in ("gate_up_proj", "down_proj"))
    with torch.autocast("cuda", enabled=False):
        A1, B1, A2, B2 = (None if t is None else t.to(torch.bfloat16) for t in (A1, B1, A2, B2))
        return _Experts.apply(
            x_MD.to(torch.bfloat16),
            offs,
            gate_up_E2ID.to(torch.bfloat16),
            down_EDI.to(torch.bfloat16),
            A1,
            B1,
            A2,
            B2,
            scaling,
            act,
            w_M,
        )


class _Experts(torch.autograd.Function):
    """``mlp(gmm, ...)`` for frozen weights W1 (gate/up) and W2 (down), LoRA (A1, B1) and (A2, B2)
    on either or none, all bf16; the rows' weights ``w`` (or None) in the router's dtype."""

    @staticmethod
    def forward(ctx, x, offs, W1, W2, A1, B1, A2, B2, s: float, act: Callable, w):
        def project(h, W, A, B):
            y = gmm(h, W, offs)
            if A is None:
                return y, None
            t = gmm(h, A, offs) * s  # scaled at rank r
            return y + gmm(t, B, offs), t

        def run():
            gu, t1 = project(x, W1, A1, B1)
            y, t2 = project(activate(gu, act, w), W2, A2, B2)
            return y, gu, t1, t2

        y, gu, t1, t2 = kept("experts", run)
        keep_x = x if A1 is not None else None  # x only for A1's gradient: the layer's largest tensor
        ctx.save_for_backward(keep_x, offs, W1, W2, A1, B1, A2, B2, gu, t1, t2, w)
        ctx.s, ctx.act = s, act
        ctx.fused = fused(act, x)  # as ``activate`` chose
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offs, W1, W2, A1, B1, A2, B2, gu, t1, t2, w = ctx.saved_tensors
        if ctx.fused:  # the activation again only for the down LoRA's gradient
            from kiln_kernels.moe import triton as kernels

            h = kernels.swiglu_forward(gu, w) if A2 is not None else None
            dh, dA2, dB2 = _project_back(dy, h, offs, W2, A2, B2, t2, ctx.s, True)
            dgu, dw = kernels.swiglu_backward(gu, dh, w)
        else:
            with torch.enable_grad():  # the activation again, from the kept gate/up product
                gu = gu.detach().requires_grad_()
                wg = w.detach().requires_grad_() if w is not None else None
                h = weigh(ctx.act(*gu.chunk(2, -1)), wg)
            dh, dA2, dB2 = _project_back(dy, h.detach(), offs, W2, A2, B2, t2, ctx.s, True)
            grads = torch.autograd.grad(h, [gu] if wg is None else [gu, wg], dh)
            dgu, dw = grads[0], grads[1] if wg is not None else None
        dx, dA1, dB1 = _project_back(dgu, x, offs, W1, A1, B1, t1, ctx.s, ctx.needs_input_grad[0])
        return dx, None, None, None, dA1, dB1, dA2, dB2, None, None, dw.to(w.dtype) if dw is not None else None


def _project_back(
    dy: torch.Tensor,
    h: torch.Tensor | None,
    offs: torch.Tensor,
    W: torch.Tensor,
    A: torch.Tensor | None,
    B: torch.Tensor | None,
    t: torch.Tensor | None,
    s: float,
    need_dh: bool,
):
    """(dh, dA, dB) of y = gmm(h, W) + gmm(gmm(h, A) * s, B), t = gmm(h, A) * s: the grouped GEMMs
    autograd's backward of ``gmm`` runs (rows: dy W_e; weights: dy_e^T h_e), summed as it sums."""
    dA = dB = dt = dh = None
    if A is not None:
        assert B is not None and t is not None and h is not None  # the LoRA pair comes whole, with its product
        dB = torch._grouped_mm(dy.t(), t, offs=offs)
        dt = torch._grouped_mm(dy, B, offs=offs) * s
        dA = torch._grouped_mm(dt.t(), h, offs=offs)
    if need_dh:
        dh = torch._grouped_mm(dy, W, offs=offs)
        if dt is not None and A is not None:  # dt is set only with A
            dh = dh + torch._grouped_mm(dt, A, offs=offs)
    return dh, dA, dB
