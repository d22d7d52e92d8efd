#!/usr/bin/env bash
# The README's headline table: the default pair on the first 10 HumanEval prompts (chat, up to
# 128 new tokens, greedy, K=15, W=6, theta 0.3) in one interleaved run: llama.cpp's own server,
# plain and with its n-gram speculation, and its binding's plain decoding, first; then flyspec
# on llama.cpp's forwards (FLy at K=15 and -k auto) and on its torch engine (the target alone
# and FLy, float32). Needs scripts/setup.sh --llamacpp (which builds llama-server) and
# flyspec models pull --gguf. About 20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
methods="llama-server,llama-server-ngram-mod,llamacpp-target,llamacpp-fly@15,llamacpp-fly@auto"
methods="$methods,target,fly@15"
.venv/bin/flyspec bench --dataset humaneval --limit 10 --max-tokens 128 --methods "$methods" \
    --output "${1:-results/bench-headline}"
