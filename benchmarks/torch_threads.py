"""Does it matter which thread runs torch? The same generation timed on the thread that loaded
the models, then on a second thread, then on the first again, in one process::

    .venv/bin/python benchmarks/torch_threads.py --max-new-tokens 64 --repeats 3

torch's CPU kernels keep an OpenMP team per calling thread. Once a second thread has run
them, the process holds more OpenMP threads than cores, and libgomp stops its workers
spinning between parallel regions: every region then waits for a wake-up. This is why
``flyspec serve`` loads its models on the thread that generates. Run it with
``OMP_NUM_THREADS=1`` (one thread per team: no effect expected) or
``OMP_WAIT_POLICY=PASSIVE`` (never spinning: slow everywhere) to see the mechanism.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

from flyspec import config as cfg
from flyspec.cli import options as cli
from flyspec.support.cpu_math import configure_cpu_math

PROMPT = "def fibonacci(n):\n    "


def main(argv: list[str] | None = None) -> int:
    configure_cpu_math()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_model_arguments(parser)
    cli.add_backend_arguments(parser)
    flags, settings = cli.max_tokens_option(default=64, help="default 64")
    cli.add_option(parser, *flags, **settings)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per stage (3)")
    parser.add_argument("--mode", choices=cfg.MODES, default="fly")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeats < 1:
        parser.error("--max-tokens and --repeats must be >= 1")
    from flyspec.support.machine import CpuMonitor, describe_machine, machine_identity

    config = cfg.DecodeConfig(mode=args.mode, max_new_tokens=args.max_new_tokens)
    engine = cli.load_engine(args, with_draft=config.uses_draft_model)
    prompt_ids = engine.encode(PROMPT)
    engine.generate(prompt_ids, config)  # warm-up on the loading thread

    def seconds() -> float:
        return engine.generate(prompt_ids, config).stats.seconds

    second = ThreadPoolExecutor(max_workers=1)
    stages = [
        ("the loading thread", seconds),
        ("a second thread", lambda: second.submit(seconds).result()),
        ("the loading thread again", seconds),
    ]
    print(f"machine: {describe_machine(machine_identity())}")
    print(
        f"{args.mode}, {args.max_new_tokens} new tokens, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; median of {args.repeats}:"
    )
    with CpuMonitor() as monitor:
        results = [
            (name, statistics.median(run() for _ in range(args.repeats))) for name, run in stages
        ]
    first = results[0][1]
    for name, value in results:
        print(f"  {name:26s} {value:7.3f} s  ({value / first:.2f}x the first)")
    print(f"during the run {monitor.load.describe()}")
    second.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
