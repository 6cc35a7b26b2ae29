"""Which implementation of an op runs, per backend: the CUDA kernel on CUDA tensors, the Ascend
variant on NPU tensors (torch_npu), the PyTorch reference elsewhere (the CPU, float64 inputs, mixed
devices, an NPU op with no Ascend variant yet, or ``KILN_KERNELS=reference`` anywhere, to compare
or to debug); and the hook through which Swap Core keeps a kernel's outputs (``kept``).

``OPS`` names, for each op, its reference, its CUDA kernel and its Ascend variant (None: the
reference runs on an NPU), with why that Ascend choice; kiln_kernels/ASCEND.md has the table and
what scripts/check_ascend.sh checked of each (lowered to triton-ascend's ttadapter IR, run in its
interpreter). An NPU tensor never reaches a CUDA-only kernel: ``fast()`` (the CUDA kernel runs) is
false there.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

Backend = Literal["cuda", "npu", "reference"]


def fast(*tensors: torch.Tensor) -> bool:
    """True when the CUDA kernel should run on these inputs: all on CUDA, none float64 (float64
    is for checking, and the kernels sum in fp32)."""
    return backend(*tensors) == "cuda"


def backend(*tensors: torch.Tensor) -> Backend:
    """Whose kernels these inputs take: ``cuda`` (all on CUDA, none float64), ``npu`` (all on an
    Ascend NPU, none float64), else ``reference`` (and always where KILN_KERNELS=reference)."""
    if os.environ.get("KILN_KERNELS", "auto") == "reference":
        return "reference"
    first = tensors[0].device.type if tensors else "cuda"  # (a CPU tensor's answer after one look)
    if first == "cuda" and all(t.is_cuda and t.dtype != torch.float64 for t in tensors):
        return "cuda"
    if first == "npu" and all(t.device.type == "npu" and t.dtype != torch.float64 for t in tensors):
        # a grid may pass 65,535 programs (a program per row): triton-ascend then maps the
        # programs onto the cores in a loop (launching as many as there are); our kernels'
        # programs never wait for each other, which is what this setting asks
        os.environ.setdefault("TRITON_ALL_BLOCKS_PARALLEL", "1")
        return "npu"
    return "reference"


@dataclass(frozen=True)
class Op:
    """An op's implementations, as module paths (imported only when chosen: the kernels import
    triton, which only accelerator machines have). ``npu`` None: the reference runs on an NPU."""

    reference: str
    cuda: str | None
    npu: str | None
    why: str  # the Ascend choice, and what would change it


_K = "kiln_kernels."
OPS: dict[str, Op] = {
    "kda_chunk": Op(
        _K + "kda.reference",
        _K + "kda.triton",
        _K + "kda.triton",
        "the same Triton source, dot precision from the backend (ieee on an NPU: Ascend rejects tf32, "
        "and takes hf32 on fp32 operands only); lowers to ttadapter at its fp32 and bf16 signatures",
    ),
    "kda_gate": Op(
        _K + "kda.reference",
        _K + "kda.gate",
        _K + "kda.gate",
        "the same Triton source (elementwise, one pass each way): lowers as it is",
    ),
    "short_conv": Op(
        _K + "conv.reference",
        _K + "conv.triton",
        _K + "conv.triton",
        "the same Triton source: lowers as it is",
    ),
    "rms_norm": Op(
        _K + "norm.reference",
        _K + "norm.triton",
        _K + "norm.triton",
        "the same Triton source (rows per tile, vector cores): lowers as it is; torch_npu.npu_rms_norm "
        "is the fused alternative, not taken yet: it weighs before rounding to x's dtype where the "
        "reference rounds first (bf16 results differ), and it always makes the weight's gradient",
    ),
    "gated_rms_norm": Op(
        _K + "norm.reference",
        _K + "norm.triton",
        _K + "norm.triton",
        "the same Triton source: lowers as it is (torch_npu has no gated RMSNorm)",
    ),
    "linear_cross_entropy": Op(
        _K + "loss.reference",
        _K + "loss.triton",
        _K + "loss.triton",
        "the same host code (matmuls through torch_npu's GEMMs) and Triton row kernel: lowers as it is",
    ),
    "depth_attention": Op(
        _K + "attnres.reference",
        _K + "attnres.triton",
        _K + "attnres.triton",
        "the same Triton source (a row per program, vector cores): lowers as it is",
    ),
    "dsa": Op(  # indexer top-k, sparse attention, the indexer's KL loss
        _K + "dsa.reference",
        _K + "dsa.triton",
        _K + "dsa.triton",
        "the same Triton source, dot precision from the backend: lowers at fp32 and bf16 (MLA's 576/512 "
        "heads); torch_npu's sparse attention operators take other layouts and no indexer loss",
    ),
    "varlen_attention": Op(
        _K + "attention.reference",
        _K + "attention.flash",
        _K + "attention.npu",
        "torch_npu.npu_fusion_attention (CANN's FlashAttentionScore): TND layout, the documents' cumulative "
        "ends as actual_seq_qlen / actual_seq_kvlen, sparse_mode 3 (causal, bottom-right aligned, as ours) with "
        "its 2048 x 2048 mask; its docs give q, k and v one head dim, so MLA's v (128) is padded to 192 and the "
        "output sliced. Written, unit-tested against a stand-in torch_npu, never run on an NPU: see ASCEND.md",
    ),
    "moe_permute": Op(  # permute / unpermute (engine/model/common/moe.py)
        _K + "moe.reference",
        _K + "moe.triton",
        _K + "moe.triton",
        "the same Triton source (a program per token, no atomics): lowers as it is",
    ),
    "swiglu": Op(  # the experts' weighed SwiGLU on gate/up rows, a dense MLP's on two tensors
        _K + "moe.reference",
        _K + "moe.triton",
        None,
        "the Triton source lowers (fp32 and bf16, tests/ascend/lower.py) and passes 3.2's interpreter, but "
        "an NPU composes silu and mul until the kernel has run on one: the experts' NPU path (moe/npu.py) "
        "is checked only against a stand-in torch_npu, which runs no Triton",
    ),
    "grouped_mlp": Op(
        _K + "moe.reference",
        _K + "moe.grouped",
        _K + "moe.npu",
        "torch_npu.npu_grouped_matmul (CANN's GroupedMatmul): one packed x, all experts' weights as one [E, K, N] "
        "tensor, group_list the cumulative counts (group_list_type 0), group_type 0 / split_item 2; the weights' "
        "gradient through group_type 2 (our autograd Function, as MindSpeed's). Written, unit-tested against a "
        "stand-in torch_npu, never run on an NPU: see ASCEND.md",
    ),
}


def choice(op: str, *tensors: torch.Tensor) -> str:
    """The module that runs ``op`` on these inputs."""
    entry, kind = OPS[op], backend(*tensors)
    return (entry.cuda if kind == "cuda" else entry.npu if kind == "npu" else None) or entry.reference


def impl(op: str, *tensors: torch.Tensor) -> ModuleType:
    """``choice``'s module, imported (a kernel module imports triton: accelerator machines only).
    Every op call asks: an imported module comes from ``sys.modules`` without the import system."""
    name = choice(op, *tensors)
    return sys.modules.get(name) or importlib.import_module(name)


def dot_precision(t: torch.Tensor) -> str:
    """``input_precision`` for a Triton kernel's dot products on inputs like ``t``: IEEE for fp32,
    so fp32 meets its 1e-5 tolerance (tf32 would not), the default (tf32) elsewhere on CUDA. On an
    NPU IEEE always: triton-ascend rejects tf32, and its hf32 (Ascend's tf32) only on fp32 operands,
    while a kernel's one precision serves its bf16 products and its fp32 ones (KDA's diagonal
    blocks) alike; those fp32 products are then exact, as in the backward on CUDA."""
    if t.dtype == torch.float32 or t.device.type == "npu":
        return "ieee"
    return "tf32"


@functools.lru_cache
def npu_cores(index: int) -> tuple[int, int]:
    """An NPU's (cube cores, vector cores): AI cores run tl.dot programs, vector cores the rest.
    torch_npu's device properties name both; triton-ascend's driver, the fallback, names them too."""
    props = torch.get_device_module("npu").get_device_properties(index)
    cube, vector = getattr(props, "cube_core_num", 0), getattr(props, "vector_core_num", 0)
    if not cube:
        import triton  # triton-ascend, on an NPU machine

        found = triton.runtime.driver.active.utils.get_device_properties(index)
        cube, vector = found["num_aicore"], found["num_vectorcore"]
    return int(cube), int(vector or 2 * cube)


def sms(t: torch.Tensor, vector: bool = False) -> int:
    """The programs t's device runs at once (a persistent grid's size): a CUDA GPU's streaming
    multiprocessors; an NPU's AI (cube) cores, or its vector cores for kernels with no tl.dot
    (``vector``); 4 in Triton's interpreter (CPU tensors)."""
    if t.is_cuda:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    if t.device.type == "npu":
        index = t.device.index if t.device.index is not None else torch.get_device_module("npu").current_device()
        return npu_cores(index)[1 if vector else 0]
    return 4


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor (chunk tables, document offsets) onto ``device`` without a host sync: a
    plain copy from pageable memory waits for the stream, and the queue runs dry at every call.
    CUDA only: elsewhere (an NPU too, until torch_npu's pinned copies are measured) a plain copy."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda":  # already there, or no copy engine
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # the pinned block is reused only after the copy


TABLES = 16  # document tables kept (a step's few layouts, and the next step's if it repeats them)
_tables: OrderedDict[tuple, Any] = OrderedDict()
_tables_lock = threading.Lock()


def document_table(key: tuple, build: Callable[[], Any]) -> Any:
    """``build()`` once per ``key`` (the kernel's name, the documents' host offsets as a tuple, the
    device): a step's layers, its recomputes and the next steps of the same layout share one table
    (KDA's chunks, the convolution's document starts, attention's offsets) instead of each layer
    building it on the host and copying it over while the GPU waits. The last TABLES are kept; the
    kernels only read them."""
    with _tables_lock:
        if key in _tables:
            _tables.move_to_end(key)
            return _tables[key]
    value = build()
    with _tables_lock:
        _tables[key] = value
        while len(_tables) > TABLES:
            _tables.popitem(last=False)
    return value


# Swap Core (engine/memory) sets this while a recomputed block runs. ``kept(name, fn)`` then keeps
# fn's outputs in the block's forward and, in its recompute, hands them back instead of calling
# fn again: a kernel's forward whose outputs include what its backward saves is never rerun.
_keeper: Callable[[str, Callable[[], Any]], Any] | None = None


def kept(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, unless Swap Core keeps calls named ``name`` (kernels' forwards, selections)."""
    return fn() if _keeper is None else _keeper(name, fn)


@contextmanager
def keeping(keeper: Callable[[str, Callable[[], Any]], Any]) -> Iterator[None]:
    global _keeper
    before, _keeper = _keeper, keeper
    try:
        yield
    finally:
        _keeper = before
