"""The lean forward against transformers' ``model(...)``, interleaved in one process.

For each model of the default pair (as every command prepares it: int8 draft, oneDNN-packed
float32 target), times one forward over ``n`` new tokens on a cache of ``--context`` random
tokens with both forward paths, alternating lean / transformers call by call so that a drifting
machine load hits both alike, and prints the medians and their ratio::

    .venv/bin/python benchmarks/forward_paths.py --draft-repeats 40 --target-repeats 8
"""

from __future__ import annotations

import argparse
import statistics
import sys

from flyspec.support.cpu_math import configure_cpu_math


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=250, help="cached positions (250)")
    parser.add_argument("--new-tokens", default="1,16", help="n values, comma-separated")
    parser.add_argument("--draft-repeats", type=int, default=40)
    parser.add_argument("--target-repeats", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = [int(value) for value in args.new_tokens.split(",") if value.strip()]
    if args.context < 1 or not sizes or min(sizes) < 1:
        parser.error("--context and every --new-tokens value must be >= 1")

    configure_cpu_math()
    from flyspec.bench.forward_cost import time_forwards
    from flyspec.cli import build_parser
    from flyspec.cli.options import load_engine

    engine = load_engine(build_parser().parse_args(["generate", "x"]), with_draft=True)
    print("| model | n | lean ms | transformers ms | lean / transformers |")
    print("|---|---:|---:|---:|---:|")
    models = (
        ("draft", engine.draft_model, args.draft_repeats),
        ("target", engine.target_model, args.target_repeats),
    )
    for role, model, repeats in models:
        times = time_forwards(
            model,
            new_tokens=sizes,
            forward_paths=("lean", "transformers"),
            context_tokens=args.context,
            repeats=repeats,
        )
        for n in sizes:
            lean = 1000 * statistics.median(times["lean"][n])
            plain = 1000 * statistics.median(times["transformers"][n])
            print(f"| {role} | {n} | {lean:.1f} | {plain:.1f} | {lean / plain:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
