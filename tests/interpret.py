"""Where the kernel tests (tests/gpu/test_dsa_cuda.py, test_moe_triton.py) run: on CUDA, or on
the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before triton was first
imported (tests/unit/test_kernels_interpreted.py starts such a process).

Triton 3.6's interpreter holds scalars as one-element arrays and turns them into loop bounds with
``int(array)``, which NumPy >= 2.3 refuses for arrays of one dimension; the patch takes the
element instead."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
)
gpu_only = pytest.mark.skipif(INTERPRETED, reason="bf16 and large shapes: not in the interpreter")

if INTERPRETED:
    import triton.runtime.interpreter as interpreter

    _patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
