# Sourced by quickstart.sh and test.sh: make .venv and install Kiln into it with the given extras.
# torch is named first with an exact version so pip takes the CPU build where one is on disk
# (a plain "torch" would pull gigabytes of CUDA libraries); every other version is pinned by
# scripts/constraints.txt.
set -euo pipefail
extras="$1"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c scripts/constraints.txt "torch==2.13.0" -e ".[${extras}]"
