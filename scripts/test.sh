#!/usr/bin/env bash
# Set up (with llama.cpp's binding), pull the default models, their GGUF files and the datasets
# (the end-to-end tests use them), lint, and run
# the whole test suite: flyspec's own in .venv, the vLLM plugin's (tests/vllm) in .venv-vllm
# (vLLM 0.32's CPU build), then vLLM 0.34's built-in FLy (tests/vllm_fly) in .venv-vllm-fly,
# its Triton kernels under Triton's interpreter. Arguments go to the first pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/flyspec models pull --gguf
.venv/bin/flyspec datasets pull
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check --quiet src tests benchmarks scripts

run_pytest() {  # run_pytest PYTHON ARGS...: pytest, where collecting no test is a failure
    local status=0
    "$1" -m pytest -q "${@:2}" || status=$?
    if [ "$status" -eq 5 ]; then
        echo "pytest collected no tests: failing" >&2
        return 1
    fi
    return "$status"
}

run_pytest .venv/bin/python "$@"
bash scripts/setup.sh --vllm
run_pytest .venv-vllm/bin/python tests/vllm
bash scripts/setup.sh --vllm-fly
TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" run_pytest .venv-vllm-fly/bin/python tests/vllm_fly
