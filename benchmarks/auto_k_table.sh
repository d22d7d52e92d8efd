#!/usr/bin/env bash
# The -k auto table of docs/benchmarks.md: -k auto against fixed block sizes and plain
# decoding on both backends (llama.cpp's forwards and flyspec's torch engine), llama-server's
# plain decoding first (the table published before it joined was measured without it), in one
# interleaved run over the first 10 HumanEval prompts (chat, 128 new tokens, greedy).
# Needs scripts/setup.sh --llamacpp and flyspec models pull --gguf. About 40 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
methods="llama-server,llamacpp-target"
for k in 3 8 15 auto; do methods="$methods,llamacpp-fly@$k"; done
methods="$methods,llamacpp-spd@3,llamacpp-spd@auto,target"
for k in 3 8 15 auto; do methods="$methods,fly@$k"; done
methods="$methods,spd,spd@auto"
.venv/bin/flyspec bench --dataset humaneval --limit 10 --max-tokens 128 \
    --methods "$methods" --output "${1:-results/bench-auto-k}"
# The llama.cpp rows against plain llama.cpp again, three interleaved passes (about 12 minutes).
.venv/bin/flyspec bench --dataset humaneval --limit 10 --max-tokens 128 --repeats 3 \
    --methods llama-server,llamacpp-target,llamacpp-fly@auto,llamacpp-spd@auto \
    --output "${1:-results/bench-auto-k}-llamacpp-repeats"
