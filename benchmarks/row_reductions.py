"""What the per-row reductions of verification cost on the CPU: torch's own argmax and top-3
beside flyspec's (``flyspec.decoding.verify.greedy_tokens`` and ``largest_values``), over
rows of the default pair's vocabulary (151,936 logits), for one row (a token of the target
alone) and 16 (a block of 15 and its bonus row).

    python benchmarks/row_reductions.py [--repeats 200]

Each is checked to give torch's own result first; times are medians over the repeats, in
microseconds, with torch's threads as the process has them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flyspec.decoding.verify import greedy_tokens, largest_values  # noqa: E402
from flyspec.support.machine import describe_machine, machine_identity  # noqa: E402

VOCAB = 151_936


def median_us(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"{describe_machine(machine_identity())}; microseconds, median of {args.repeats}\n")
    print("| rows | reduction | torch | flyspec | torch / flyspec |")
    print("|---:|---|---:|---:|---:|")
    for rows in (1, 16):
        logits = torch.randn(rows, VOCAB, generator=generator)
        cases = [
            ("argmax", lambda x=logits: x.argmax(dim=-1), lambda x=logits: greedy_tokens(x)),
            (
                "top-3 values",
                lambda x=logits: x.topk(3, dim=-1).values,
                lambda x=logits: largest_values(x, 3),
            ),
        ]
        for name, theirs, ours in cases:
            if not torch.equal(theirs(), ours()):
                raise SystemExit(f"{name} over {rows} rows differs from torch's")
            torch_us, ours_us = median_us(theirs, args.repeats), median_us(ours, args.repeats)
            print(
                f"| {rows} | {name} | {torch_us:.1f} | {ours_us:.1f} | {torch_us / ours_us:.1f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
