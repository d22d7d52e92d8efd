#!/usr/bin/env bash
# Whether a change to the code left flyspec's output and speed as they were: the first 5
# HumanEval prompts (chat, 128 new tokens) with target, spd, fly, llamacpp-target and
# llamacpp-fly@auto, run on REV's tree and then on this working tree with the same .venv and
# models, then compared (`flyspec bench --compare`): the prompts on which each method generated
# the same tokens and the same statistics (rounds, accepted, tau, deferrals, ...), and each
# method's speed against the noise. METHODS replaces the five; the arguments after it go to
# both runs of `flyspec bench` (for instance --defer).
#   bash benchmarks/same_output_check.sh REV [OUTPUT_FOLDER] [METHODS] [BENCH_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/same_output_check.sh REV [OUTPUT_FOLDER] [METHODS] [BENCH_ARGS...]" >&2
    exit 2
fi
rev=$(git rev-parse --verify --quiet "$1^{commit}") || { echo "not a commit: $1" >&2; exit 2; }
here=$(pwd)
out=${2:-results/same-output-${rev:0:7}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tree=$(mktemp -d)
git worktree add --detach "$tree" "$rev" >/dev/null
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
methods=${3:-target,spd,fly,llamacpp-target,llamacpp-fly@auto}
# --max-new-tokens, the former name of --max-tokens: REV's tree may predate the new one.
args=(--dataset humaneval --limit 5 --methods "$methods" --max-new-tokens 128 --no-progress
    "${@:4}")
(cd "$tree" && PYTHONPATH="$tree/src" "$here/.venv/bin/python" -m flyspec.cli bench "${args[@]}" \
    --output "$out/old")
.venv/bin/flyspec bench "${args[@]}" --output "$out/new" --compare "$out/old/bench.json"
