#!/usr/bin/env bash
# The table of docs/benchmarks.md "llama.cpp beside flyspec": llama.cpp's own decoding of the
# default pair's GGUF files (llama-server, plain and ngram-mod, first; the table published
# before they joined was measured without them), flyspec's loop on llama.cpp forwards at K = 3, 5, 8, 15 and auto,
# and flyspec's torch engine, in one interleaved run over the first 10 HumanEval prompts (128
# new tokens, greedy); then the forward costs of both backends and the break-even ratios.
# Needs scripts/setup.sh --llamacpp and flyspec models pull --gguf. About 40 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
methods="llama-server,llama-server-ngram-mod,llamacpp-target,llamacpp-lookup"
for method in spd fly fly-mla ngram; do
    for k in 3 5 8 15; do methods="$methods,llamacpp-$method@$k"; done
done
methods="$methods,llamacpp-fly@auto,target,spd,fly,fly@auto"
.venv/bin/flyspec bench --dataset humaneval --limit 10 --max-tokens 128 \
    --methods "$methods" --output results/bench-llamacpp
.venv/bin/flyspec bench --forward-cost --backend llamacpp --output results/forward-cost-llamacpp
.venv/bin/flyspec bench --forward-cost --output results/forward-cost-torch
.venv/bin/python benchmarks/break_even.py results/bench-llamacpp/bench.json \
    --torch results/forward-cost-torch/forward-cost.json \
    --llamacpp results/forward-cost-llamacpp/forward-cost.json
