"""bench/dsa.py's ``--previous``: an earlier copy of the DSA kernels, timed beside today's in the
same run, is that copy's code, its Gluon kernels too (a copy of triton.py alone would import
today's hopper.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpret import triton_env

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path

import torch

import tests.interpret  # noqa: F401  (the interpreter's patch)
from bench.dsa import load_previous
from kiln_kernels.dsa import triton as today

prev = load_previous(Path(sys.argv[1]))
assert prev.__file__ == str(Path(sys.argv[1]).resolve() / "triton.py"), prev.__file__
names = prev._hopper.__code__.co_names  # the modules its dispatch imports: the copy's
assert "previous_dsa" in names and not any(n.startswith("kiln_kernels") for n in names), names
import previous_dsa.hopper as hopper

assert hopper.COPY and "kiln_kernels.dsa.hopper" not in sys.modules
assert load_previous(Path(sys.argv[1])) is prev  # once a process
try:
    load_previous(Path(sys.argv[2]))
except ValueError as e:
    assert "one previous copy a process" in str(e), e
else:
    raise AssertionError("a second folder loaded")
g = torch.Generator().manual_seed(0)
q, k, w = (torch.randn(1, 40, *shape, generator=g) for shape in ((4, 16), (16,), (4,)))
starts = torch.zeros(1, 40, dtype=torch.long)
mine, theirs = today.indexer_topk(q, k, w, starts, 8), prev.indexer_topk(q, k, w, starts, 8)
assert mine.shape == (1, 40, 8) and (mine == theirs).all()
single = load_previous(Path(sys.argv[1]) / "triton.py")
assert (single.indexer_topk(q, k, w, starts, 8) == mine).all()
print("ok")
"""


@pytest.mark.timeout(300)
def test_previous_folder_runs_its_own_kernels(tmp_path):
    copy, other = tmp_path / "dsa", tmp_path / "other"
    for folder in (copy, other):
        shutil.copytree(ROOT / "kiln_kernels" / "dsa", folder, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "hopper.py").open("a") as f:
        f.write("\nCOPY = True\n")
    with (copy / "__init__.py").open("a") as f:  # the package's: registers torch ops, must not run
        f.write("\nraise RuntimeError('the copy\\'s __init__.py ran')\n")
    # a bytecode cache of the copy as it stands (a cached module is not the copy's renamed one)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(copy)], check=True)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(copy), str(other)],
        cwd=ROOT,
        env=triton_env(TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-3000:]
