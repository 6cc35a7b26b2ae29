"""Causal attention over packed documents on CUDA (``reference.py`` has the definition): torch's
variable-length attention kernels, called through their aten ops so that one code path serves
every torch since 2.2 (the public ``torch.nn.attention.varlen`` changed its signature twice).
No [T, S] mask anywhere: each kernel walks only the key blocks of the query's own document.

- ``flash``: FlashAttention-2's variable-length kernels. They need one head dim for q, k and v,
  so the narrower side is padded with zeros (MLA: q/k 192, v 128 -> v padded to 192; the padded
  output columns are zero and are dropped). 16-bit inputs only.
- ``efficient``: the memory-efficient (CUTLASS) kernels, any head dims, fp32 too; the causal
  mask aligned to the bottom right (``custom_mask_type`` 2), as flash's is.
- ``sdpa``: where every document has as many queries as keys and all have one length (one
  document; rows of equal documents), the documents as a batch through
  ``F.scaled_dot_product_attention(is_causal=True)``, which takes cuDNN's Hopper kernels for 16-bit
  inputs and any head dims (faster than ``flash`` at MLA's shape: bench/RESULTS.md, "Full
  attention over packed documents"). Other layouts go to ``flash``.

``BF16_BACKEND`` is the one 16-bit inputs take (bench/attention.py and bench/e2e.py on the H200,
bench/RESULTS.md); fp32 takes ``efficient``. The varlen kernels' forwards are kept by Swap Core as
the other kernels' are (``kept("attention")``): the recompute never runs them again; SDPA's is an
aten op (Swap Core's ``attention`` class).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln_kernels.dispatch import document_table, kept, to_device

aten = torch.ops.aten
BF16_BACKEND = "sdpa"


def _offsets(cu: torch.Tensor, device) -> tuple[torch.Tensor, int]:
    """Host offsets -> int32 on the device (no host sync) and the longest document; made once for
    a layout (``document_table``)."""
    cu = cu.to("cpu", torch.int32)

    def make() -> tuple[torch.Tensor, int]:
        return to_device(cu, device), int(cu.diff().max()) if len(cu) > 1 else 0

    return document_table(("attention offsets", tuple(cu.tolist()), torch.device(device)), make)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        D, E = q.shape[-1], v.shape[-1]
        P = -(-max(D, E) // 8) * 8  # one head dim, a multiple of 8
        q, k, v = _pad(q, P), _pad(k, P), _pad(v, P)

        def run():
            out, lse, rng, unused, _ = aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
            )
            return out, lse, rng, unused

        out, lse, rng, unused = kept("attention", run)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.shape = (max_q, max_k, scale, D, E)
        return out[..., :E]

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, scale, D, E = ctx.shape
        do = _pad(do.contiguous(), out.shape[-1])
        dq, dk, dv = aten._flash_attention_backward(
            do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale
        )
        return dq[..., :D], dk[..., :D], dv[..., :E], None, None, None, None, None


class _Efficient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        def run():
            out, lse, seed, offset, _, _ = aten._efficient_attention_forward(
                q[None], k[None], v[None], None, cu_q, cu_k, max_q, max_k, 0.0, 2, True, scale=scale
            )
            return out, lse, seed, offset

        out, lse, seed, offset = kept("attention", run)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.shape = (max_q, max_k, scale)
        return out[0]

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.shape
        dq, dk, dv, _ = aten._efficient_attention_backward(
            do.contiguous()[None],
            q[None],
            k[None],
            v[None],
            None,
            out,
            cu_q,
            cu_k,
            max_q,
            max_k,
            lse,
            0.0,
            seed,
            offset,
            2,
            False,
            scale=scale,
        )
        return dq[0], dk[0], dv[0], None, None, None, None, None


def _uniform(cu_q: torch.Tensor, cu_k: torch.Tensor) -> int | None:
    """The one length of every document when all have it, queries and keys alike; else None."""
    if not torch.equal(cu_q, cu_k) or len(cu_q) < 2:
        return None
    lengths = cu_q.diff()
    L = int(lengths[0])
    return L if L > 0 and bool((lengths == L).all()) else None


def _sdpa(q, k, v, L: int, scale: float) -> torch.Tensor:
    """Documents of L tokens each as a batch [N, H, L, .] through SDPA, causal."""
    q, k, v = (x.unflatten(0, (-1, L)).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2).flatten(0, 1)


BACKENDS: dict[str, type[_Flash] | type[_Efficient] | None] = {"flash": _Flash, "efficient": _Efficient, "sdpa": None}


def varlen_attention(
    q_THD: torch.Tensor,
    k_SHD: torch.Tensor,
    v_SHE: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``reference.varlen_attention``'s function (same arguments; offsets in host memory) on
    CUDA. ``backend`` for the benchmark; by default ``BF16_BACKEND`` for 16-bit inputs and
    ``efficient`` for fp32."""
    cu_k = cu_q if cu_k is None else cu_k
    if backend is None:
        backend = BF16_BACKEND if q_THD.dtype in (torch.bfloat16, torch.float16) else "efficient"
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.to(q_THD.dtype) for x in (q_THD, k_SHD, v_SHE))
    if backend == "sdpa":
        L = _uniform(cu_q.cpu(), cu_k.cpu())
        if L is not None:
            return _sdpa(q, k, v, L, scale)
        backend = "flash"
    (dq, max_q), (dk, max_k) = _offsets(cu_q, q_THD.device), _offsets(cu_k, q_THD.device)
    q, k, v = (x.contiguous() for x in (q, k, v))
    fn = BACKENDS[backend]
    assert fn is not None  # sdpa fell back to flash above
    return fn.apply(q, k, v, dq, dk, max_q, max_k, scale)
