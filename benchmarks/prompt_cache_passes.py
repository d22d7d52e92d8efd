"""Prompts that come back: 8 different requests sent twice through the same server, and the
second pass's speed over the first's, end to end. llama-server keeps recent prompts in host
memory (its ``--cache-ram``, on by default); ``flyspec serve`` with its prompt cache over many
prompts (``--cache-ram``, the default), and with the last request's only (``--cache-ram 0``)::

    .venv/bin/python benchmarks/prompt_cache_passes.py [--backend llamacpp|torch] [--limit 8]

The requests are the first ``--limit`` humaneval-edit problems (chat, greedy, up to
``--max-tokens`` new tokens), plain decoding (flyspec in mode target), through the ``openai``
client. Each server starts fresh, as a child on a free port (llama-server on the target's GGUF
with flyspec's llama.cpp threads and context). About 6 minutes on 2 cores with llama.cpp.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from served import PassRun, llama_serving, serving, timed_pass  # noqa: E402

from flyspec.bench.prompts import dataset_prompts  # noqa: E402
from flyspec.support.machine import cpuinfo, git_commit  # noqa: E402

FLYSPEC_SETTINGS = {
    "flyspec serve (--cache-ram, the default)": [],
    "flyspec serve --cache-ram 0": ["--cache-ram", "0"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = dataset_prompts("humaneval-edit", limit=args.limit, chat=True)
    passes: dict[str, list[PassRun]] = {}
    with llama_serving() as url:
        passes["llama-server"] = [timed_pass(url, prompts, max_tokens=args.max_tokens)]
        passes["llama-server"].append(timed_pass(url, prompts, max_tokens=args.max_tokens))
    flyspec = ["--backend", args.backend, "--mode", "target"]
    for name, extra in FLYSPEC_SETTINGS.items():
        with serving([*flyspec, *extra], start_seconds=300) as url:
            runs = [timed_pass(url, prompts, max_tokens=args.max_tokens)]
            runs.append(timed_pass(url, prompts, max_tokens=args.max_tokens))
            passes[name] = runs
    cpu = cpuinfo()
    print(
        f"commit {git_commit(ROOT)}, CPU {cpu.get('model name', platform.machine())} (family "
        f"{cpu.get('cpu family')}, model {cpu.get('model')}), backend {args.backend}, "
        f"{len(prompts)} prompts, max_tokens {args.max_tokens}"
    )
    print("\n| server | first pass tok/s | second pass tok/s | second over first | same answers |")
    print("|---|---:|---:|---:|---|")
    for name, (first, second) in passes.items():
        rates = [first.tokens_per_second, second.tokens_per_second]
        same = sum(a == b for a, b in zip(first.answers, second.answers, strict=True))
        print(
            f"| {name} | {rates[0]:.2f} | {rates[1]:.2f} | {rates[1] / rates[0]:.2f}x | "
            f"{same}/{len(prompts)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
