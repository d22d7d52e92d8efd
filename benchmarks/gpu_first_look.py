"""The first GPU figures in one run: forward costs, flyspec's engine against the bandwidth
bound, the decoding loop's own cost per round, the compiled forward, and speed at the real
pair's recorded acceptance (trace replay), with the checks that the engine's tokens are right.

No weights travel: the models are random-weight models with the shapes of the default pair
(Qwen2.5-Coder 0.5B drafting, 1.5B target) and of a 7B and a 32B Qwen2.5 target
(``benchmarks/gpu_configs/*/config.json``), built in bfloat16 on the device::

    bash benchmarks/name_tree.sh                                 # before: names the tree's commit
    python benchmarks/gpu_first_look.py                          # a CUDA GPU (not yet timed)
    python benchmarks/gpu_first_look.py --quick                  # the goals' rows only
    python benchmarks/gpu_first_look.py --targets 1.5b,7b        # a subset of the targets
    python benchmarks/gpu_first_look.py --device cpu --rehearse --quick   # the lease, rehearsed
    python benchmarks/gpu_first_look.py --device cpu --tiny      # tiny shapes on the CPU

``--rehearse`` runs on the CPU the sequence a lease runs, with or without ``--quick``: the same
distinct models, each with its real layers, heads and vocabulary and a width of its own
(``first_look.models.REHEARSAL_WIDTH_DIVISOR``), in the same dtypes (bfloat16, and float32 for
the same tokens), the same phases and the same compiles in the same order, with no time limit:
what would stop a lease on a GPU (a compile that fails, a model that cannot build) stops it
here first. ``--tiny`` is a quicker check of the script: every model of one tiny shape, so one
model's graphs serve all (it cannot see what each new shape costs).

It prints one table (Markdown) and writes it as ``gpu_first_look.json`` and
``gpu_first_look.md`` under ``$OUT`` when that is set, and under ``--output DIR``. Progress goes
to stderr. A phase that fails (out of memory, say) is a row marked failed with its reason, and
the other phases go on; phases that would start after ``--time-limit`` seconds are skipped. The
rows name flyspec's commit (:func:`flyspec.support.machine.git_commit`: the checkout's, or the
``TREE_COMMIT`` file ``benchmarks/name_tree.sh`` writes into a copy; else "unknown").

The parts are in ``benchmarks/first_look/``: the phases in their order in ``run.py``, each
phase's rows in a module of ``phases/`` whose docstring says what they hold (``bandwidth``,
``model``, ``same tokens``, ``forward cost``, ``engine alone``, ``profile``, ``loop overhead``,
``projection``, ``kernel check``, ``attention``, ``compiled``, ``replay``, then the tables of
``compiles`` and ``goal``). ``--quick`` runs the attention, compiled and replay phases with the
replays the goals name, the targets largest first, then the same tokens' lossless and compiled
rows; every phase says on stderr how long it took and the graphs it compiled.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from first_look.models import REHEARSAL_WIDTH_DIVISOR, TARGETS
from first_look.run import FirstLook
from first_look.table import log, markdown, write_outputs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU form)")
    shapes.add_argument(
        "--rehearse",
        action="store_true",
        help="the CPU rehearsal: every model with its real layers, heads and vocabulary, "
        f"narrowed {REHEARSAL_WIDTH_DIVISOR}-fold, no time limit unless given",
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help="some of 1.5b,7b,32b")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--output", type=Path, help="also write the JSON and Markdown here")
    parser.add_argument(
        "--time-limit",
        type=float,
        help="skip phases that would start later (s; default 420, with --quick 300; none with "
        "--rehearse or --tiny)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on the CPU (default 1: shared cores)"
    )
    parser.add_argument("--kernel-batches", type=int, help="conformance batches (default 60)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the rows the goals name: the same tokens (lossless, compiled against eager), "
        "the targets compiled, the loop's cost per round, the goals' replays",
    )
    args = parser.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = math.inf if args.rehearse or args.tiny else 300 if args.quick else 420
    first_look = FirstLook(args)
    env, rows = first_look.run()
    print(markdown(rows), flush=True)
    for folder in first_look.folders:
        write_outputs(folder, env, rows)
        log(f"wrote {folder}/gpu_first_look.json and .md")
    failed = [r for r in rows if r.status == "failed"]
    log(f"done in {env['elapsed_s']} s: {len(rows)} rows, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
