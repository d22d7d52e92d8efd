"""Record the traces that ``benchmarks/gpu_first_look.py`` replays on a GPU: every round's block
size, kept tokens and source, for flyspec's methods on the real default pair
(:mod:`flyspec.bench.replay`)::

    .venv/bin/python benchmarks/record_traces.py            # about 15 minutes on 2 cores

- ``benchmarks/traces/humaneval.json``: the first 10 HumanEval prompts (chat, 128 new tokens
  at most, greedy, W=6, theta=0.3): FLy and exact SPD with the draft model, K = 8 and 15.
- ``benchmarks/traces/humaneval-edit.json``: the first 8 humaneval-edit problems (chat, 384 new
  tokens at most, greedy), each with its prediction (Predicted Outputs): exact verification,
  prompt lookup where the answer leaves the prediction, K = 15 and 64; and K = 15 with the
  draft model drafting the new text (``predict-draft``).

The engine is the one ``flyspec bench`` runs (float32 target on the CPU kernels, int8 draft);
its rounds are what a trace keeps, so the CPU's speed does not enter them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import date
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent / "src"))

from flyspec.bench.methods import FlyspecMethod, method_base  # noqa: E402
from flyspec.bench.prompts import dataset_prompts, encode_prediction, encode_prompts  # noqa: E402
from flyspec.bench.replay import Trace, save_traces, traced_request  # noqa: E402
from flyspec.config import DecodeConfig  # noqa: E402
from flyspec.support.machine import describe_machine, git_commit, machine_identity  # noqa: E402

SETS = {
    "humaneval": {
        "limit": 10,
        "max_new_tokens": 128,
        "methods": ("fly@8", "fly@15", "spd@8", "spd@15"),
    },
    "humaneval-edit": {
        "limit": 8,
        "max_new_tokens": 384,
        "methods": ("predict@15", "predict@64", "predict-draft@15"),
    },
}


def record(
    engine, dataset: str, *, limit: int, max_new_tokens: int, methods: Sequence[str]
) -> list[Trace]:
    """The traces of ``methods`` on the first ``limit`` prompts of ``dataset``."""
    prompts = dataset_prompts(dataset, limit=limit, chat=True)
    prompt_ids = encode_prompts(engine.tokenizer, prompts)
    predictions = [encode_prediction(engine.tokenizer, prompt) for prompt in prompts]
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    traces = []
    for name in methods:
        method = FlyspecMethod(name, engine, config)
        requests = []
        started = time.perf_counter()
        for ids, prediction in zip(prompt_ids, predictions, strict=True):
            run = method.run(
                ids, max_new_tokens=max_new_tokens, seed=None, prediction_ids=prediction
            )
            requests.append(traced_request(run.stats))
        trace = Trace(
            name=name,
            mode=method.config.mode,
            drafter=method.config.drafter,
            prediction=method.uses_prediction,
            requests=tuple(requests),
        )
        print(
            f"{dataset} {name}: tau {trace.tau:.2f} over {trace.rounds} rounds "
            f"({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        traces.append(trace)
    return traces


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=BENCHMARKS / "traces")
    parser.add_argument("--sets", default=",".join(SETS), help="some of " + ",".join(SETS))
    args = parser.parse_args(argv)
    from flyspec.engine import Engine

    engine = Engine.load()
    args.output.mkdir(parents=True, exist_ok=True)
    machine, commit = describe_machine(machine_identity()), git_commit()  # what runs
    for dataset in args.sets.split(","):
        settings = SETS[dataset]
        traces = record(engine, dataset, **settings)
        recorded = {
            "date": date.today().isoformat(),
            "commit": commit,
            "machine": machine,
            "command": "python benchmarks/record_traces.py",
            "pair": f"{engine.draft_name} drafting for {engine.target_name}",
            "settings": (
                f"first {settings['limit']} {dataset} prompts (chat), {settings['max_new_tokens']} "
                "new tokens at most, greedy, W=6, theta=0.3; the bench's torch engine"
            ),
            "methods": {name: method_base(name) for name in settings["methods"]},
        }
        save_traces(args.output / f"{dataset}.json", traces, recorded=recorded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
