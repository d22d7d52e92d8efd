"""What ``-k auto`` costs a process's first request on llama.cpp: in a fresh process, one
96-token completion (chat, greedy) with the target alone, then the same with FLy under
``-k auto``, the first request that measures the forward costs. Twice: with no costs kept
under ``$FLYSPEC_HOME/forward-costs`` (as on a new machine: the request probes them; every
kept cost is forgotten first), then with the costs the first process kept::

    .venv/bin/python benchmarks/auto_k_first_request.py     # about 2 minutes on 2 cores

Needs ``scripts/setup.sh --llamacpp`` and ``flyspec models pull --gguf``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PROMPT = (
    "Write a Python function that tells whether a string is a palindrome, ignoring case and "
    "spaces, with a docstring."
)


def one_process() -> dict:
    """The target alone, then FLy under -k auto, in this process: tokens per second each."""
    from flyspec.config import DecodeConfig
    from flyspec.decoding.stats import RequestStats
    from flyspec.engine import Engine

    engine = Engine.load(backend="llamacpp")
    prompt = engine.encode(PROMPT, chat=True)
    speeds = {}
    for name, config in (
        ("target", DecodeConfig(mode="target", max_new_tokens=96)),
        ("fly@auto", DecodeConfig(mode="fly", auto_k=True, max_new_tokens=96)),
    ):
        stats = RequestStats()
        started = time.perf_counter()
        tokens = sum(1 for _ in engine.decoder.stream(prompt, config, stats=stats))
        speeds[name] = tokens / (time.perf_counter() - started)
        speeds[f"{name}_tau"] = stats.tau
    speeds["kept_costs"] = str(engine.decoder.auto_k_store.path)
    return speeds


def main() -> int:
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(one_process()))
        return 0
    from flyspec.support.home import flyspec_home

    shutil.rmtree(flyspec_home() / "forward-costs", ignore_errors=True)
    for label in ("no costs kept (probed)", "costs kept by the run before"):
        child = subprocess.run(
            [sys.executable, __file__, "--child"], capture_output=True, text=True, check=True
        )
        speeds = json.loads(child.stdout.strip().splitlines()[-1])
        ratio = speeds["fly@auto"] / speeds["target"]
        print(
            f"{label}: target alone {speeds['target']:.2f} tok/s, fly@auto "
            f"{speeds['fly@auto']:.2f} tok/s (tau {speeds['fly@auto_tau']:.2f}): {ratio:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
