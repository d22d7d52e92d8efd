"""``flyspec bench``: speed of flyspec's methods and transformers' peers, side by side.

Every method runs on the same models and prompts, interleaved per prompt (A B C A B C ...)
so that a noisy machine's drift hits all alike, after one untimed warm-up generation each.
``--forward-cost`` instead times one forward over n = 1 .. K+1 new tokens on each model.

Heavy imports (torch, transformers, matplotlib) happen inside the functions, so that
``flyspec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from flyspec.bench.methods import (
    ALL_METHODS,
    DEFAULT_METHODS,
    FLYSPEC_METHODS,
    LOSSLESS_METHODS,
    METHODS_NEEDING_DRAFT,
    make_method,
    parse_methods,
)
from flyspec.bench.prompts import DATASET_NAMES, BenchPrompt
from flyspec.errors import FlyspecError

__all__ = ["add_parser", "run_bench", "run_benchmark"]

# Flags of flyspec.cli.add_decode_arguments that the bench takes over as they are; the
# others (--mode, --drafter: each method fixes them; --stop, --draft-temperature) do not apply.
BENCH_DECODE_FLAGS = (
    "k",
    "window",
    "theta",
    "entropy",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "max_new_tokens",
    "draft_confidence",
)


def add_parser(commands) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to the ``flyspec`` subparsers."""
    from flyspec import cli

    bench = commands.add_parser(
        "bench",
        help="measure speed: flyspec's methods and transformers' peers side by side",
        description="Measure the speed of flyspec's methods and transformers' peers on the same "
        "models and prompts, interleaved per prompt; or (--forward-cost) the cost of a multi-token "
        "forward relative to a one-token forward.",
    )
    cli.add_model_arguments(bench)
    _add_decode_flags(bench, BENCH_DECODE_FLAGS)
    bench.set_defaults(mode="fly", drafter="model", stop=[], draft_temperature=0.0)
    bench.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated, from {', '.join(ALL_METHODS)} "
        f"(default: {','.join(DEFAULT_METHODS)}); target is always included",
    )
    source = bench.add_mutually_exclusive_group()
    source.add_argument(
        "--dataset", default="humaneval", choices=DATASET_NAMES, help="default: humaneval"
    )
    source.add_argument(
        "--prompts-file",
        help='JSONL file, one {"prompt": ..., "id": ...} per line, instead of a dataset',
    )
    bench.add_argument("--limit", type=int, default=10, help="number of prompts (default 10)")
    bench.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the tokenizer has one)",
    )
    bench.add_argument(
        "--output", help="output folder (default: results/bench-<dataset>-<timestamp>)"
    )
    bench.add_argument("--json", action="store_true", help="also print the JSON report to stdout")
    bench.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    bench.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    cost = bench.add_argument_group("forward cost")
    cost.add_argument(
        "--forward-cost",
        action="store_true",
        help="instead: time one forward over n = 1..K+1 new tokens on each model",
    )
    cost.add_argument(
        "--context-tokens", type=int, default=200, help="KV cache length (default 200)"
    )
    cost.add_argument("--repeats", type=int, default=5, help="timed repeats per n (default 5)")
    bench.set_defaults(handler=run_bench)
    return bench


def _add_decode_flags(parser: argparse.ArgumentParser, dests: Sequence[str]) -> None:
    """Reuse the definitions of :func:`flyspec.cli.add_decode_arguments` for some flags only."""
    from flyspec import cli

    scratch = argparse.ArgumentParser(add_help=False)
    cli.add_decode_arguments(scratch)
    for action in scratch._actions:
        if action.dest in dests:
            parser._add_action(action)


def _check_args(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise FlyspecError(f"--limit must be >= 1, got {args.limit}")
    if args.threads is not None and args.threads < 1:
        raise FlyspecError(f"--threads must be >= 1, got {args.threads}")
    if args.repeats < 1 or args.context_tokens < 1:
        raise FlyspecError("--repeats and --context-tokens must be >= 1")


def run_bench(args: argparse.Namespace) -> int:
    from flyspec import cli
    from flyspec.runtime import set_torch_threads

    _check_args(args)
    methods = parse_methods(args.methods)
    config = cli.decode_config_from_args(args)
    if args.threads is not None:
        set_torch_threads(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.forward_cost:
        output = Path(args.output or f"results/forward-cost-{stamp}")
        return _run_forward_cost(args, config, output)

    engine = cli.load_engine(args, with_draft=bool(METHODS_NEEDING_DRAFT.intersection(methods)))
    kernels = engine.kernels
    chat = args.chat
    if chat is None:
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
    if args.prompts_file:
        from flyspec.bench.prompts import read_prompts_file

        prompts = read_prompts_file(args.prompts_file, limit=args.limit, chat=chat)
        dataset = Path(args.prompts_file).stem
    else:
        from flyspec.bench.prompts import dataset_prompts

        prompts = dataset_prompts(args.dataset, limit=args.limit, chat=chat)
        dataset = args.dataset
    output = Path(args.output or f"results/bench-{dataset}-{stamp}")

    report = run_benchmark(
        engine, prompts, methods, config, progress=args.progress, dataset=dataset
    )
    report["config"].update(device=args.device, dtype=args.dtype, chat=chat, kernels=kernels)
    from flyspec.bench.report import markdown_table, write_report

    files = write_report(report, output)
    if config.sampling.greedy:
        for summary in report["methods"]:
            if summary["method"] in LOSSLESS_METHODS and (
                summary["identical_to_target"] < summary["samples"]
            ):
                print(
                    f"flyspec: warning: {summary['method']} is lossless but "
                    f"{summary['samples'] - summary['identical_to_target']} of its outputs "
                    "differ from the target's",
                    file=sys.stderr,
                )
    table = markdown_table(report["methods"])
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        print(table, file=sys.stderr)
    else:
        print(table)
    print(f"wrote {', '.join(files)} to {output}", file=sys.stderr)
    return 0


def run_benchmark(
    engine,
    prompts: Sequence[BenchPrompt],
    method_names: Sequence[str],
    config,
    *,
    progress: bool = True,
    dataset: str = "prompts",
    warmup: bool = True,
) -> dict:
    """Run every method on every prompt, interleaved per prompt; return the report (config,
    environment, per-method figures and per-sample records). ``config`` (a DecodeConfig)
    carries K, the FLy rule, sampling and ``max_new_tokens``; each method sets its own mode."""
    from tqdm import tqdm

    from flyspec.bench.prompts import encode_prompts
    from flyspec.bench.report import environment, sample_record, summarise_method

    method_names = parse_methods(",".join(method_names))
    if not prompts:
        raise FlyspecError("no prompts to benchmark")
    methods = [make_method(name, engine, config) for name in method_names]
    prompt_ids = encode_prompts(engine, prompts)
    seed = config.sampling.seed

    def sample_seed(index: int) -> int | None:
        return None if seed is None else seed + index

    if warmup:
        warmup_tokens = min(config.max_new_tokens, 2 * (config.k + 1))
        for method in tqdm(methods, desc="warm-up", file=sys.stderr, disable=not progress):
            method.run(prompt_ids[0], max_new_tokens=warmup_tokens, seed=sample_seed(0))

    runs: dict[str, list] = {method.name: [] for method in methods}
    bar = tqdm(
        total=len(prompts) * len(methods), desc="bench", file=sys.stderr, disable=not progress
    )
    with bar:
        for index, ids in enumerate(prompt_ids):
            for method in methods:
                bar.set_postfix_str(f"{prompts[index].id} {method.name}", refresh=False)
                runs[method.name].append(
                    method.run(ids, max_new_tokens=config.max_new_tokens, seed=sample_seed(index))
                )
                bar.update()

    target_runs = runs["target"]
    samples: dict[str, list[dict]] = {}
    summaries = []
    for method in methods:
        records = [
            sample_record(
                prompts[index].id,
                len(prompt_ids[index]),
                run.token_ids,
                run.seconds,
                target_runs[index].token_ids,
                stats=run.stats.as_dict() if run.stats is not None else None,
                text=engine.tokenizer.decode(run.token_ids, skip_special_tokens=True),
            )
            for index, run in enumerate(runs[method.name])
        ]
        samples[method.name] = records
        rounds = (
            [r for run in runs[method.name] for r in run.stats.rounds]
            if method.name in FLYSPEC_METHODS
            else None
        )
        summaries.append(
            summarise_method(
                method.name,
                records,
                rounds,
                [r["tokens_per_second"] for r in samples["target"]],
                k=config.k,
                settings=method.settings,
            )
        )
    return {
        "config": {
            "dataset": dataset,
            "prompts": len(prompts),
            "methods": list(method_names),
            "max_new_tokens": config.max_new_tokens,
            "k": config.k,
            "window": config.fly.window,
            "theta": config.fly.theta,
            "entropy": config.fly.entropy,
            "temperature": config.sampling.temperature,
            "top_k": config.sampling.top_k,
            "top_p": config.sampling.top_p,
            "seed": seed,
            "max_ngram": config.max_ngram,
            "mla_proposals": config.mla_proposals,
            "draft_confidence": config.draft_confidence,
            "target": engine.target_name,
            "draft": engine.draft_name,
            "warmup": warmup,
            "timing": "wall time of each call (prefill included), interleaved per prompt",
        },
        "environment": environment(),
        "methods": summaries,
        "prompts": [prompt.as_dict() for prompt in prompts],
        "samples": samples,
    }


def _run_forward_cost(args: argparse.Namespace, config, output: Path) -> int:
    from flyspec import cli
    from flyspec.bench.forward_cost import format_forward_cost, measure_forward_cost
    from flyspec.bench.report import environment

    engine = cli.load_engine(args, with_draft=True)
    kernels = engine.kernels
    models = {"draft": engine.draft_model, "target": engine.target_model}
    costs = {}
    for role, model in models.items():
        print(f"timing the {role} ...", file=sys.stderr, flush=True)
        costs[role] = measure_forward_cost(
            model,
            max_new_tokens=config.k + 1,
            context_tokens=args.context_tokens,
            repeats=args.repeats,
            forward_path=args.forward,
        )
    table = format_forward_cost(costs)
    report = {
        "config": {
            "k": config.k,
            "context_tokens": args.context_tokens,
            "repeats": args.repeats,
            "target": engine.target_name,
            "draft": engine.draft_name,
            "dtype": args.dtype,
            "device": args.device,
            "kernels": kernels,
        },
        "environment": environment(),
        "forward_cost": {role: [c.as_dict() for c in rows] for role, rows in costs.items()},
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "forward-cost.json").write_text(json.dumps(report, indent=2) + "\n")
    (output / "forward-cost.md").write_text(table + "\n")
    if args.json:
        print(json.dumps(report))
        print(table, file=sys.stderr)
    else:
        print(table)
    print(f"wrote forward-cost.json, forward-cost.md to {output}", file=sys.stderr)
    return 0
