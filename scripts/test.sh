#!/usr/bin/env bash
# Set up, pull the default models and datasets (the end-to-end tests use them), lint, and run
# the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/flyspec models pull
.venv/bin/flyspec datasets pull
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check --quiet src tests benchmarks
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
