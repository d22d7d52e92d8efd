#!/usr/bin/env bash
# The tables of docs/benchmarks.md "Beside llama-server": llama.cpp's own server, plain and with
# its n-gram speculation, set beside flyspec on the same GGUF files, on the humaneval-edit task
# (the first 8 problems, chat, up to 384 new tokens, greedy).
#   1. Three passes through the servers, end to end, every setting a fresh server in every pass
#      (benchmarks/served_passes.py; Markdown in OUTPUT_PREFIX-served.md), the settings the
#      goals compare: llama-server plain and with both its n-gram speculations (ngram-mod,
#      ngram-simple at 16), flyspec serve in mode target, and flyspec's edit path (the code as
#      the prediction, exact, -k auto).
#   2. One pass of flyspec bench, in one process, where decoding is timed apart from reading
#      the prompt: the same settings, and llama-server's draft model, the binding's plain
#      decoding, and flyspec's prediction path at K=15, FLy and with the draft.
#   3. The prompt caches: the same 8 requests sent twice through each server (llama-server,
#      flyspec serve with its prompt cache and with the last prompt's only), plain decoding,
#      the second pass over the first (benchmarks/prompt_cache_passes.py; Markdown in
#      OUTPUT_PREFIX-prompt-cache.md).
# Needs scripts/setup.sh --llamacpp (which builds llama-server) and flyspec models pull --gguf.
# About 45 minutes on 2 cores. Usage: benchmarks/llama_server_table.sh [OUTPUT_PREFIX]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/bench-llama-server}"
mkdir -p "$(dirname "$out")"
.venv/bin/python benchmarks/served_passes.py --passes 3 --limit 8 --max-tokens 384 \
    --output "$out-served.json" | tee "$out-served.md"
common=(--dataset humaneval-edit --limit 8 --max-tokens 384)
methods="llama-server,llama-server-ngram-mod,llama-server-ngram-simple@16,llama-server-draft@8"
methods="$methods,llamacpp-flyspec-target,llamacpp-target,llamacpp-predict@auto"
methods="$methods,llamacpp-predict,llamacpp-fly-predict@auto,llamacpp-predict-draft@auto"
.venv/bin/flyspec bench "${common[@]}" --output "$out-all" --methods "$methods"
.venv/bin/python benchmarks/prompt_cache_passes.py --backend llamacpp --limit 8 --max-tokens 384 \
    | tee "$out-prompt-cache.md"
