"""bench/dsa.py's ``--previous``: an earlier copy of the DSA kernels, timed beside today's in the
same run, is that copy's code, its Gluon kernels too (a copy of triton.py alone would import
today's hopper.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path

import torch

import tests.interpret  # noqa: F401  (the interpreter's patch)
from bench.dsa import load_previous
from kiln_kernels.dsa import triton as today

prev = load_previous(Path(sys.argv[1]))
assert prev.__name__ == "previous_dsa.triton" and prev.__file__.startswith(sys.argv[1]), prev.__file__
assert "previous_dsa" in prev._hopper.__code__.co_names, prev._hopper.__code__.co_names
assert "kiln_kernels" not in prev._hopper.__code__.co_names
import previous_dsa.hopper as hopper

assert hopper.COPY and not hasattr(sys.modules["kiln_kernels.dsa.triton"], "COPY")
assert prev._attn_fwd is not today._attn_fwd
g = torch.Generator().manual_seed(0)
q, k, w = (torch.randn(1, 40, *shape, generator=g) for shape in ((4, 16), (16,), (4,)))
starts = torch.zeros(1, 40, dtype=torch.long)
mine, theirs = today.indexer_topk(q, k, w, starts, 8), prev.indexer_topk(q, k, w, starts, 8)
assert mine.shape == (1, 40, 8) and (mine == theirs).all()
single = load_previous(Path(sys.argv[1]) / "triton.py")
assert single.__name__ == "previous_dsa_triton" and (single.indexer_topk(q, k, w, starts, 8) == mine).all()
print("ok")
"""


@pytest.mark.timeout(300)
def test_previous_folder_runs_its_own_kernels(tmp_path):
    site = ROOT / ".triton"
    assert (site / "triton").is_dir(), "triton is not in .triton: run scripts/test.sh (it installs it there)"
    copy = tmp_path / "dsa"
    shutil.copytree(ROOT / "kiln_kernels" / "dsa", copy, ignore=shutil.ignore_patterns("__pycache__"))
    # a bytecode cache of the copy as it stands (a cached module is not the copy's renamed one)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(copy)], check=True)
    with (copy / "hopper.py").open("a") as f:
        f.write("\nCOPY = True\n")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(copy)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-3000:]
