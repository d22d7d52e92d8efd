#!/usr/bin/env bash
# llama.cpp's plain decoding and its binding's prompt lookup on one long chat prompt (an edit
# of a 6,000-character module of this repository: about 1,500 prompt tokens), 400 new tokens:
# the lookup's logits buffer must hold the prompt, the new tokens and a block.
# Needs scripts/setup.sh --llamacpp and flyspec models pull --gguf. About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-results/bench-long-chat-lookup}"
mkdir -p "$output"
.venv/bin/python - "$output/prompts.jsonl" <<'PYTHON'
import json
import sys
from pathlib import Path

module = Path("src/flyspec/evaluation/tasks.py").read_text()[:6000]
prompt = "Add type hints to every function of this module and give back the whole module:\n\n"
row = {"id": "add-types-tasks", "prompt": prompt + module, "chat": True}
Path(sys.argv[1]).write_text(json.dumps(row) + "\n")
PYTHON
.venv/bin/flyspec bench --prompts-file "$output/prompts.jsonl" --max-tokens 400 \
    --methods llamacpp-target,llamacpp-lookup --output "$output"
