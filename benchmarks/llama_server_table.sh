#!/usr/bin/env bash
# The tables of docs/benchmarks.md "Beside llama-server": llama.cpp's own server, plain and with
# its n-gram speculation, set beside flyspec on the same GGUF files, on the humaneval-edit task
# (the first 8 problems, chat, up to 384 new tokens, greedy).
#   1. Three interleaved passes (medians and ranges) of the settings the goals compare:
#      llama-server plain and with both its n-gram speculations (ngram-mod, ngram-simple at
#      16), flyspec's loop in mode target on llama.cpp, and flyspec's edit path (the code as
#      the prediction, exact, -k auto).
#   2. One pass of every other setting: llama-server's draft model, the binding's plain
#      decoding, and flyspec's prediction path at K=15, FLy and with the draft.
#   3. The prompt caches: the same 8 requests sent twice through each server (llama-server,
#      flyspec serve with its prompt cache and with the last prompt's only), plain decoding,
#      the second pass over the first (benchmarks/prompt_cache_passes.py; Markdown in
#      OUTPUT_PREFIX-prompt-cache.md).
# Needs scripts/setup.sh --llamacpp (which builds llama-server) and flyspec models pull --gguf.
# About 60 minutes on 2 cores. Usage: benchmarks/llama_server_table.sh [OUTPUT_PREFIX]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/bench-llama-server}"
common=(--dataset humaneval-edit --limit 8 --max-tokens 384)
.venv/bin/flyspec bench "${common[@]}" --repeats 3 --output "$out-repeats" \
    --methods llama-server,llama-server-ngram-mod,llama-server-ngram-simple@16,llamacpp-flyspec-target,llamacpp-predict@auto
methods="llama-server,llama-server-draft@8"
methods="$methods,llamacpp-target,llamacpp-predict,llamacpp-fly-predict@auto"
methods="$methods,llamacpp-predict-draft@auto"
.venv/bin/flyspec bench "${common[@]}" --output "$out-all" --methods "$methods"
.venv/bin/python benchmarks/prompt_cache_passes.py --backend llamacpp --limit 8 --max-tokens 384 \
    | tee "$out-prompt-cache.md"
