#!/usr/bin/env bash
# The Edits table of docs/benchmarks.md: Predicted Outputs on the humaneval-edit task (the
# first 8 problems; chat, up to 384 new tokens, greedy), in one interleaved run: llama-server
# plain and with ngram-mod first (the table published before they joined was measured without
# them; docs/benchmarks.md "Beside llama-server" has them), plain llama.cpp's binding,
# the binding's own prompt lookup (the code is in the prompt), generic n-gram drafting, and
# flyspec's prediction drafter on llama.cpp's forwards and on the torch engine, exact and FLy,
# fixed K=15 and -k auto. Then llama.cpp's forward costs V(n)/V(1) on the same machine.
# Needs scripts/setup.sh --llamacpp and flyspec models pull --gguf. About 30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/bench-edits}"
methods="llama-server,llama-server-ngram-mod,llamacpp-target,llamacpp-lookup,llamacpp-ngram"
methods="$methods,llamacpp-predict,llamacpp-predict@auto,llamacpp-fly-predict,llamacpp-fly-predict@auto"
methods="$methods,target,predict,predict@auto,fly-predict"
.venv/bin/flyspec bench --dataset humaneval-edit --limit 8 --max-tokens 384 \
    --methods "$methods" --output "$out"
.venv/bin/flyspec bench --forward-cost --backend llamacpp --output "$out-forward-cost"
