"""Causal attention over packed documents on an Ascend NPU (``reference.py`` has the definition):
``torch_npu.npu_fusion_attention``, CANN's FlashAttentionScore, in its packed layout. Written
from torch_npu's documentation and checked only against a stand-in ``torch_npu`` that implements
that contract in plain PyTorch on the CPU (tests/unit/test_npu_fused.py): the operator itself has
never run here, nor has any of this on an NPU.

The contract, from torch_npu's API reference (``torch_npu.npu_fusion_attention``, PyTorch
adapter 6.0.0, hiascend.com .../Pytorch/600/apiref/apilist/ptaoplist_000850.html):

- ``input_layout="TND"``: q [T, N, D], k and v [S, N, D], the documents packed back to back and
  cut by ``actual_seq_qlen`` / ``actual_seq_kvlen`` (required with TND), host ``int[]`` of the
  documents' *cumulative ends* ("lengths 2 2 2 2 2 -> pass 2 4 6 8 10"): ``cu_q[1:]``, ``cu_k[1:]``.
- ``sparse_mode=3`` ("rightDownCausal"): causal, the mask aligned at the bottom right of each
  document's [Sq, Skv] block: query i sees keys j <= i + Skv - Sq, the reference's alignment
  (our queries are the last keys). This mode takes the "optimised compressed" mask: a
  2048 x 2048 bool ``atten_mask``, True above the diagonal (True = masked out), on the device;
  ``pre_tockens`` / ``next_tockens`` are ignored in it.
- ``scale`` is the factor on q k^T (the operator's default is 1, not D^-1/2: always passed);
  ``head_num`` is N; ``keep_prob`` stays 1 (no dropout). The call returns 7 values, [0] is the
  attention output [T, N, D_v]. The backward is torch_npu's autograd for the operator (torch_npu
  pairs it with ``npu_fusion_attention_grad``); that it is registered for TND was not seen here:
  the stand-in's is plain autograd.

Head dims (MLA: q/k 192, v 128). The training operator's documentation gives one head dim D for
q, k and v (H = N * D for all three), and MindSpore's binding of the same CANN operator
(``mindspore.ops.flash_attention_score``) says value has "the same dtype and shape as key"; a
narrower value head is documented only for the inference operator (FusedInferAttentionScore, TND:
"queryD and keyD equal 192 and valueD equal 128"). So, as flash.py does for FlashAttention-2, the
narrower side is padded with zeros to one head dim and the output sliced: v 128 -> 192, its 64
extra output columns are zero and dropped (the padded v's gradient columns are dropped by
autograd's pad). Costs 50% more of the P V product and of dV at MLA's shape; to revisit once a
CANN release documents D_v != D_qk for FlashAttentionScore, and on an NPU.

Documents with neither queries nor keys are left out of the lengths (the operator's docs say
nothing of an empty batch entry); one with keys and no queries stays (its queries' length 0):
to be checked on an NPU. Not kept by Swap Core (``kept``): forward and backward are torch_npu's
own autograd node, so a recompute runs the forward again.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln_kernels.attention.reference import check_offsets

MASK_SIZE = 2048  # sparse_mode 2, 3 (and 4, 7, 8): the compressed causal mask is always 2048 x 2048
SPARSE_RIGHT_DOWN_CAUSAL = 3


@functools.lru_cache(maxsize=8)
def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed mask sparse_mode 3 takes: [2048, 2048] bool, True (masked) above the diagonal."""
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def varlen_attention(
    q_THD: torch.Tensor,
    k_SHD: torch.Tensor,
    v_SHE: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``reference.varlen_attention``'s function (same arguments; offsets in host memory) on an
    NPU, through ``torch_npu.npu_fusion_attention`` (TND, sparse_mode 3): o [T, H, E] in q's dtype."""
    import torch_npu  # an NPU machine's (CANN beneath it); imported here, when an NPU tensor came

    cu_k = cu_q if cu_k is None else cu_k
    T, H, D = q_THD.shape
    E = v_SHE.shape[-1]
    a, b = check_offsets(cu_q, cu_k, T, k_SHD.shape[0])
    scale = D**-0.5 if scale is None else scale
    if T == 0:
        return q_THD.new_zeros(0, H, E)
    # cumulative ends, without the documents that have neither queries nor keys
    ends = [(q1, k1) for q0, q1, k0, k1 in zip(a, a[1:], b, b[1:], strict=False) if q1 > q0 or k1 > k0]
    P = max(D, E)  # one head dim for q, k and v (see the module's docstring)
    q, k, v = (_pad(x.to(q_THD.dtype), P) for x in (q_THD, k_SHD, v_SHE))
    out = torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        H,
        "TND",
        atten_mask=causal_mask(q.device),
        scale=float(scale),
        keep_prob=1.0,
        sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL,
        actual_seq_qlen=[int(e) for e, _ in ends],
        actual_seq_kvlen=[int(e) for _, e in ends],
    )
    return out[0][..., :E]
