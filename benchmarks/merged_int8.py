"""Merged int8 projections against torch's plain dynamic int8, interleaved in one process.

Loads the default draft twice, quantises one copy with ``torch.ao.quantization.quantize_dynamic``
(each Linear on its own) and the other with ``flyspec.models.kernels.quantize_int8`` (q/k/v and
gate/up merged), checks that both give the same logits bit for bit, then times one lean forward
over ``n`` new tokens on a cache of ``--context`` random tokens, alternating the two call by
call (``flyspec.bench.forward_cost.time_runners``), and prints the medians::

    .venv/bin/python benchmarks/merged_int8.py --repeats 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings

from flyspec.support.cpu_math import configure_cpu_math


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=260, help="cached positions (260)")
    parser.add_argument("--new-tokens", default="1,7,16", help="n values, comma-separated")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    sizes = [int(value) for value in args.new_tokens.split(",") if value.strip()]
    if args.context < 1 or not sizes or min(sizes) < 1 or args.repeats < 1:
        parser.error("--context, --repeats and every --new-tokens value must be >= 1")

    configure_cpu_math()
    import torch

    from flyspec.bench.forward_cost import time_runners
    from flyspec.models import load_causal_lm
    from flyspec.models.default_pair import default_pair_paths
    from flyspec.models.kernels import quantize_int8
    from flyspec.models.lean import LeanForward

    draft_path = default_pair_paths().draft
    plain = load_causal_lm(str(draft_path), device="cpu", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(plain, {torch.nn.Linear}, torch.qint8, inplace=True)
    merged = quantize_int8(load_causal_lm(str(draft_path), device="cpu", dtype=torch.float32))
    runners = {"plain": LeanForward(plain), "merged": LeanForward(merged)}

    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # the same logits for a prefill and for blocks of every n
        context = torch.randint(30000, (1, args.context), generator=generator)
        same = torch.equal(*(runner.forward(context, 1) for runner in runners.values()))
        for n in sizes:
            block = torch.randint(30000, (1, n), generator=generator)
            same = same and torch.equal(*(runner.forward(block, n) for runner in runners.values()))
            for runner in runners.values():
                runner.crop(args.context)
    times = time_runners(
        runners,
        vocab_size=int(plain.get_input_embeddings().weight.shape[0]),
        new_tokens=sizes,
        context_tokens=args.context,
        repeats=args.repeats,
    )
    print(f"logits bit-identical: {same}")
    print("| n | plain int8 ms | merged int8 ms | merged / plain |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        plain_ms = 1000 * statistics.median(times["plain"][n])
        merged_ms = 1000 * statistics.median(times["merged"][n])
        print(f"| {n} | {plain_ms:.1f} | {merged_ms:.1f} | {merged_ms / plain_ms:.2f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
