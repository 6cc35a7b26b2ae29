"""Run Triton kernels on the CPU through Triton's interpreter: import this module before
triton, in a process of its own (``TRITON_INTERPRET`` is read when triton is imported).

Triton 3.6's interpreter holds scalars as one-element arrays and turns them into loop bounds with
``int(array)``, which NumPy >= 2.3 refuses for arrays of one dimension; the patch takes the
element instead."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import triton.runtime.interpreter as interpreter  # noqa: E402

_patch_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor
