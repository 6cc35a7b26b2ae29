"""pytest plugin for the kernels' GPU tests through triton-ascend's interpreter (``-p
tests.ascend.interpreter_plugin``, TRITON_INTERPRET=1, triton-ascend first on the path).

tests/interpret.py patches Triton 3.6's interpreter, whose ``_patch_lang_tensor`` takes a scope;
3.2's takes none, and has the same fault the patch mends (scalars held as one-element arrays,
turned into loop bounds with ``int(array)``, which NumPy >= 2.3 refuses): the same mend, fitted to
3.2, replaces it. And 3.2's interpreter has no ``get_int1_ty`` (a mask ``m & FLAG`` with a constexpr
bool FLAG needs it: KDA's ``_walk``); 3.3 added it, as here."""

from __future__ import annotations

import triton.runtime.interpreter as interpreter

_own = interpreter._patch_lang_tensor

import tests.interpret  # noqa: E402,F401  (its DEVICE and marks; its 3.6 patch replaced below)


def _patch_lang_tensor(tensor):
    _own(tensor)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])


interpreter._patch_lang_tensor = _patch_lang_tensor
if not hasattr(interpreter.InterpreterBuilder, "get_int1_ty"):
    interpreter.InterpreterBuilder.get_int1_ty = lambda self: interpreter.tl.int1
