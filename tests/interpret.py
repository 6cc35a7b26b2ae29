"""Where the kernel tests (tests/gpu/test_dsa_cuda.py, test_moe_triton.py) run: on CUDA, or on
the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before triton was first
imported (tests/unit/test_kernels_interpreted.py starts such a process).

Triton 3.6's interpreter holds scalars as one-element arrays and turns them into loop bounds with
``int(array)``, which NumPy >= 2.3 refuses for arrays of one dimension; the patch takes the
element instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
)
gpu_only = pytest.mark.skipif(INTERPRETED, reason="bf16 and large shapes: not in the interpreter")
ROOT = Path(__file__).resolve().parents[1]


def triton_env(**more: str) -> dict[str, str]:
    """The environment of a test's subprocess that imports triton from .triton (scripts/test.sh
    installs it there, outside .venv) and sees no GPU; ``more`` on top (``TRITON_INTERPRET="1"``
    for the interpreter)."""
    site = ROOT / ".triton"
    assert (site / "triton").is_dir(), "triton is not in .triton: run scripts/test.sh (it installs it there)"
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **more}


if INTERPRETED:
    import triton.runtime.interpreter as interpreter

    _patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
