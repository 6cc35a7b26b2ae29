"""The experts on an Ascend NPU through ``torch_npu.npu_grouped_matmul`` (CANN's GroupedMatmul):
one grouped GEMM per projection for all experts, as grouped.py's torch._grouped_mm on CUDA.
Same signature as the reference; ``usable`` says when it applies. Written from torch_npu's
documentation and checked only against a stand-in ``torch_npu`` that implements that contract in
plain PyTorch on the CPU (tests/unit/test_npu_fused.py): the operator itself has never run here,
nor has any of this on an NPU.

The contract, from torch_npu's API reference (``torch_npu.npu_grouped_matmul``, PyTorch adapter
7.0.0, hiascend.com .../Pytorch/700/apiref/apilist/ptaoplist_000524.html; 6.0.RC1-6.0.0 for the
scenarios) and MindSpeed's use of it (Ascend/MindSpeed mindspeed/lite/ops/grouped_matmul.py):

- ``x`` and ``weight`` are lists. One packed x [M, K] (the rows of group 0, then group 1's, ...)
  with ``group_type=0`` (groups along M) and ``split_item=2`` (one output tensor [M, N], the
  groups' results back to back): "x single tensor, weight one per group, y single tensor".
  A weight may be 3-D [E, K, N] (7.0.0: "each tensor 2-D or 3-D"), so all experts go as one
  tensor, not a list of E (lists hold at most 128 tensors; Kimi's MoE has more experts).
  y_e = x_e @ weight_e, so our [E, N, K] weights go transposed ([E, K, N] views).
- ``group_list``: where the groups end; ``group_list_type=0``: cumulative sizes (``1``: the sizes
  themselves). Taken as an int64 tensor on the device (a 1-D Tensor, as MindSpeed passes it),
  cumulative, as grouped.py's ``offs``.
- the weights' gradient: ``group_type=2`` groups along K (the reduction axis): x [N, M] (dy^T)
  and weight [M, K] (the rows), both cut along M by the same group list; ``split_item=3`` gives
  one output [E, N, K], dW_e = dy_e^T x_e per expert. The row gradient is a group_type 0 call
  with the untransposed weights.
- dtypes: float16, bfloat16 and (Atlas A2/A3, 7.0.0) float32.

The backward is our own autograd Function (``_GMM``: the row and weight gradients as above),
not torch_npu's: MindSpeed wraps the operator the same way. With frozen expert weights (LoRA)
their gradient is never asked (``needs_input_grad``). A group of no rows (an expert no token
chose) gives zero rows and, in group_type 2, a zero weight gradient (what the stand-in does;
the docs do not say: to check on an NPU). Not kept by Swap Core (``kept``) yet: a recompute
runs the grouped GEMMs again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln_kernels.moe.grouped import mlp
from kiln_kernels.moe.reference import Lora

GROUP_M, GROUP_K = 0, 2  # group_type: groups along x's rows (M), along the reduction axis (K)
CUMULATIVE = 0  # group_list_type: group_list holds the groups' cumulative ends
ONE_OUTPUT, ALL_ONE = 2, 3  # split_item: one output tensor; one input and one output tensor
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def usable(x_MD: torch.Tensor, gate_up_E2ID: torch.Tensor, down_EDI: torch.Tensor, lora: Lora | None) -> bool:
    return x_MD.device.type == "npu" and x_MD.dtype in DTYPES


def _gmm(x_MK: torch.Tensor, W_EKN: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of group e times W_e: [M, K] x [E, K, N] -> [M, N] (groups along M)."""
    import torch_npu  # an NPU machine's (CANN beneath it); imported here, when an NPU tensor came

    out = torch_npu.npu_grouped_matmul(
        [x_MK], [W_EKN], group_list=ends, split_item=ONE_OUTPUT, group_type=GROUP_M, group_list_type=CUMULATIVE
    )
    return out[0]


def _gmm_weights(dy_MN: torch.Tensor, x_MK: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """dy_e^T x_e for every group e: [M, N], [M, K] -> [E, N, K] (groups along the reduction axis M)."""
    import torch_npu

    out = torch_npu.npu_grouped_matmul(
        [dy_MN.t()], [x_MK], group_list=ends, split_item=ALL_ONE, group_type=GROUP_K, group_list_type=CUMULATIVE
    )
    return out[0]


class _GMM(torch.autograd.Function):
    """y = rows of group e times W_e^T, W [E, N, K] (our layout: out x in), through the operator
    both ways."""

    @staticmethod
    def forward(ctx, x, W, ends):
        ctx.save_for_backward(x, W, ends)
        return _gmm(x, W.transpose(-2, -1), ends)

    @staticmethod
    def backward(ctx, dy):
        x, W, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _gmm(dy, W, ends) if ctx.needs_input_grad[0] else None
        dW = _gmm_weights(dy, x, ends) if ctx.needs_input_grad[1] else None
        return dx, dW, None


def gmm(x_MK: torch.Tensor, W_ENK: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of group e times W_e^T: [M, K] x [E, N, K] -> [M, N], ``ends`` the cumulative counts."""
    return _GMM.apply(x_MK, W_ENK.to(x_MK.dtype), ends)


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
    """[M, D] -> [M, D]: every expert on its own rows (``reference.grouped_mlp``): gate/up, the
    activation weighed by ``w_M``, down, LoRA from its factors (scaled at rank r). In x's dtype,
    or autocast's where autocast is on for x's device (as F.linear would be)."""
    kind = x_MD.device.type
    dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x_MD.dtype
    counts = counts_E.to(x_MD.device)
    return mlp(gmm, x_MD, counts, gate_up_E2ID, down_EDI, act, lora, scaling, dt, torch.int64, w_M)
