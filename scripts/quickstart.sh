#!/usr/bin/env bash
# Set up, pull the default models, and run FLy on a coding prompt with its speedup over the
# target alone measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/flyspec models pull --gguf  # the GGUF files: llama.cpp's speed too, where installed
.venv/bin/flyspec bench --chat --show --max-tokens 128 \
    --prompt "Write a Python function that returns the n-th Fibonacci number, with a docstring."
