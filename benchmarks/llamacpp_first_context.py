"""Whether the first llama.cpp context a process makes decodes slower than the next: two
runners of the default target's GGUF made one after the other in one process, each decoding
the same tokens greedily (a bare Python loop over the runner's forward), interleaved::

    .venv/bin/python benchmarks/llamacpp_first_context.py [--tokens 100] [--repeats 2]

Prints milliseconds per new token for each, per repeat.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bare_decode import bare_decode_seconds, random_prompt  # noqa: E402

from flyspec.config import LlamaCppConfig  # noqa: E402
from flyspec.models.default_pair import default_gguf_paths  # noqa: E402
from flyspec.models.llamacpp import LlamaCppForward  # noqa: E402
from flyspec.support.machine import describe_machine, machine_identity  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = default_gguf_paths().target
    prompt = random_prompt(args.prompt_tokens)
    runners = {
        name: LlamaCppForward(path, context=LlamaCppConfig().context)
        for name in ("first", "second")
    }

    def decode(runner: LlamaCppForward) -> float:
        return bare_decode_seconds(runner, prompt, args.tokens) * 1000

    print(describe_machine(machine_identity()))
    print(f"{args.prompt_tokens}-token prompt, {args.tokens} new tokens; ms per new token\n")
    print("| repeat | first context | second context | first / second |")
    print("|---:|---:|---:|---:|")
    for repeat in range(args.repeats):
        first, second = decode(runners["first"]), decode(runners["second"])
        print(f"| {repeat + 1} | {first:.2f} | {second:.2f} | {first / second:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
