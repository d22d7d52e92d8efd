#!/usr/bin/env bash
# Whether `--forward compiled` emits the lean forward's tokens on the real default pair, and
# what compiling is worth on this CPU: the first HumanEval prompts (chat, 128 new tokens) with
# target, spd and fly, torch's own layers (`--linear default --draft-quant none`, which the
# compiled forward needs), once through the lean forward and once compiled, compared
# (`flyspec bench --compare`): the prompts with the same tokens, and each method's speed.
# Compiling happens in the bench's warm-up, outside the timed runs.
#   bash benchmarks/compiled_check.sh [LIMIT] [OUTPUT_FOLDER]
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-5}
out=${2:-results/compiled-check}
args=(--dataset humaneval --limit "$limit" --methods target,spd,fly --max-tokens 128
      --linear default --draft-quant none --no-progress)
.venv/bin/flyspec bench "${args[@]}" --forward lean --output "$out/lean"
.venv/bin/flyspec bench "${args[@]}" --forward compiled --output "$out/compiled" \
    --compare "$out/lean/bench.json"
