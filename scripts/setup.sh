#!/usr/bin/env bash
# Create .venv and install flyspec into it. Usage: scripts/setup.sh [--test]
# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB
# CUDA build. On a GPU machine, install the matching torch build before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
extras="[serve]"
if [ "${1:-}" = "--test" ]; then
    extras="[serve,test]"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}"
echo "flyspec installed in $(pwd)/.venv"
