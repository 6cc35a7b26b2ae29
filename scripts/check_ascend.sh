#!/usr/bin/env bash
# The Ascend checks that need no NPU (issue #33, part 3), kiln_kernels/ASCEND.md says what they
# cover. triton-ascend 3.2.0 (+ pybind11) goes into a folder of its own, .triton-ascend/ (cached:
# installed once): it installs into the same triton/ package as upstream triton, which the main
# venv keeps for the interpreter tests (.triton/), and torch_npu never enters a venv without CANN.
#
#   scripts/check_ascend.sh               every Ascend Triton kernel lowered to ttadapter IR (~15 s)
#   scripts/check_ascend.sh --interpret   and the kernels' small GPU tests in triton-ascend's
#                                         interpreter, those 3.2's interpreter runs (minutes)
#   scripts/check_ascend.sh --resolve     and `pip install --dry-run ".[npu]"` in a throwaway venv
#                                         (needs the package index)
# The stand-in NPU's unit tests (dispatch, device layer, process group) are in the main suite:
# tests/unit/test_kernel_dispatch.py, tests/unit/test_device.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SITE=${TRITON_ASCEND_DIR:-.triton-ascend}
STAMP="$SITE/.kiln-triton-ascend-3.2.0"
if [ ! -f "$STAMP" ]; then
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-deps --target "$SITE" triton-ascend==3.2.0 "pybind11>=2.13"
  touch "$STAMP"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m tests.ascend.lower
for arg in "$@"; do
  case "$arg" in
    --interpret)
      # 3.2's interpreter: these pass at their small fp32 shapes; ASCEND.md lists what it cannot
      # run, and why (the one deselected: 3.2 reduces tl.argmax element by element, > 5 minutes).
      # Two workers (pytest-xdist), one a core.
      TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" "$PY" -m pytest -q -n 2 -p no:cacheprovider \
        -p tests.ascend.interpreter_plugin -W ignore::RuntimeWarning \
        tests/gpu/test_norm_cuda.py tests/gpu/test_attnres_cuda.py tests/gpu/test_moe_triton.py \
        tests/gpu/test_conv_cuda.py tests/gpu/test_kda_cuda.py tests/gpu/test_dsa_cuda.py \
        tests/gpu/test_kept_kernels.py tests/gpu/test_loss_cuda.py \
        --deselect tests/gpu/test_loss_cuda.py::test_small_chunks_and_all_ignored
      ;;
    --resolve)
      venv=$(mktemp -d)
      trap 'rm -rf "$venv"' EXIT
      "$PY" -m venv "$venv"
      "$venv/bin/python" -m pip install -q --dry-run ".[npu]"
      echo "pip install --dry-run .[npu]: resolves"
      ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
