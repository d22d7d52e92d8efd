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
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from flyspec.bench.methods import (
    ALL_METHODS,
    DEFAULT_METHODS,
    DEFAULT_VLLM_METHODS,
    FLYSPEC_METHODS,
    LOSSLESS_METHODS,
    METHODS_NEEDING_DRAFT,
    VLLM_METHOD_NAMES,
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
    "min_ratio",
    "max_rank",
    "defer",
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
        default=None,
        help=f"comma-separated, from {', '.join(ALL_METHODS)} "
        f"(default: {','.join(DEFAULT_METHODS)}; with --engine vllm: "
        f"{','.join(DEFAULT_VLLM_METHODS)}); the baseline (target, or vllm-target with "
        "--engine vllm) is always included",
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
    cli.add_vllm_arguments(bench)
    bench.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="with --engine vllm: also measure each vLLM method's throughput with this many "
        "requests in flight (default 1: batch 1 only)",
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
    bench.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="passes over the prompts, each running every method once per prompt in a rotated "
        "order (default 1); speeds and speedups are then medians with their range. With "
        "--forward-cost: timed repeats per n (default 5)",
    )
    bench.add_argument(
        "--compare",
        metavar="OLD_BENCH_JSON",
        help="after the run, print each method's new/old speed ratio against this earlier "
        "bench.json, marking changes larger than the noise",
    )
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
    if (args.repeats is not None and args.repeats < 1) or args.context_tokens < 1:
        raise FlyspecError("--repeats and --context-tokens must be >= 1")
    if args.engine == "vllm" and (args.repeats or 1) > 1:
        raise FlyspecError("--repeats is not supported with --engine vllm yet; drop one")
    if args.compare:
        from flyspec.bench.compare import read_bench

        read_bench(args.compare)  # a bad file is refused before any model loads
    if args.concurrency < 1:
        raise FlyspecError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.engine == "vllm" and args.forward_cost:
        raise FlyspecError("--forward-cost times flyspec's own forwards; drop --engine vllm")


def run_bench(args: argparse.Namespace) -> int:
    from flyspec import cli
    from flyspec.runtime import set_torch_threads

    _check_args(args)
    vllm_engine = args.engine == "vllm"
    methods = parse_methods(
        args.methods or ",".join(DEFAULT_VLLM_METHODS if vllm_engine else DEFAULT_METHODS),
        baseline="vllm-target" if vllm_engine else "target",
    )
    in_vllm = [name for name in methods if name in VLLM_METHOD_NAMES]
    if in_vllm and not vllm_engine:
        raise FlyspecError(f"{', '.join(in_vllm)} run in vLLM: add --engine vllm")
    config = cli.decode_config_from_args(args)
    if args.threads is not None:
        set_torch_threads(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.forward_cost:
        output = Path(args.output or f"results/forward-cost-{stamp}")
        return _run_forward_cost(args, config, output)

    if vllm_engine:
        return _run_vllm_bench(args, methods, config, stamp)

    engine = cli.load_engine(args, with_draft=bool(METHODS_NEEDING_DRAFT.intersection(methods)))
    kernels = engine.kernels
    prompts, dataset, chat = _prompts(args, engine.tokenizer)
    output = Path(args.output or f"results/bench-{dataset}-{stamp}")

    report = run_benchmark(
        engine,
        prompts,
        methods,
        config,
        progress=args.progress,
        dataset=dataset,
        repeats=args.repeats or 1,
    )
    report["config"].update(device=args.device, dtype=args.dtype, chat=chat, kernels=kernels)
    return _finish(args, report, config, output)


def _run_vllm_bench(args: argparse.Namespace, methods: list[str], config, stamp: str) -> int:
    """vLLM's methods one engine after another, then flyspec's own (interleaved), in one
    report whose speedups are over vllm-target."""
    from flyspec import cli
    from flyspec.bench.prompts import encode_prompts
    from flyspec.bench.report import decoding_settings, environment, sample_records
    from flyspec.bench.vllm import make_vllm_methods, run_vllm_methods, summarise_vllm_runs
    from flyspec.models import load_tokenizer

    if not config.sampling.greedy and config.sampling.seed is None:
        config = config.with_updates(sampling=replace(config.sampling, seed=0))
    spec = cli.vllm_engine_spec(args, config, mode="fly")
    vllm_names = [name for name in methods if name in VLLM_METHOD_NAMES]
    flyspec_names = [name for name in methods if name not in VLLM_METHOD_NAMES]
    vllm_methods = make_vllm_methods(
        vllm_names, spec, config.sampling, concurrency=args.concurrency
    )
    tokenizer = load_tokenizer(spec.target)
    prompts, dataset, chat = _prompts(args, tokenizer)
    prompts_ids = encode_prompts(tokenizer, prompts)
    output = Path(args.output or f"results/bench-{dataset}-vllm-{stamp}")

    runs = run_vllm_methods(
        vllm_methods,
        prompts_ids,
        max_new_tokens=config.max_new_tokens,
        seed=config.sampling.seed,
        concurrency=args.concurrency,
        warmup_tokens=min(config.max_new_tokens, 2 * (config.k + 1)),
        progress=args.progress,
    )
    baseline = runs[0]  # vllm-target: parse_methods puts the baseline first
    samples = {
        run.name: sample_records(
            prompts,
            prompts_ids,
            run.samples,
            baseline.samples,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        for run in runs
    }
    vllm_target_speed = [r["tokens_per_second"] for r in samples[baseline.name]]
    summaries = [
        summarise_vllm_runs(run, samples[run.name], vllm_target_speed, k=config.k) for run in runs
    ]
    report = {
        "config": {
            "dataset": dataset,
            "prompts": len(prompts),
            "methods": methods,
            "baseline": "vllm-target",
            **decoding_settings(config),
            "concurrency": args.concurrency,
            "target": spec.target,
            "draft": spec.draft,
            "vllm": {"dtype": spec.dtype or "auto", "max_model_len": spec.max_model_len},
            "chat": chat,
            "timing": "vLLM methods one engine after another, each prompt at batch 1 after "
            "a warm-up, then all prompts with `concurrency` in flight; flyspec's methods "
            "after them, interleaved per prompt",
        },
        "environment": environment(),
        "methods": summaries,
        "prompts": [prompt.as_dict() for prompt in prompts],
        "samples": samples,
    }
    if flyspec_names:
        engine = cli.load_engine(
            args, with_draft=bool(METHODS_NEEDING_DRAFT.intersection(flyspec_names))
        )
        own = run_benchmark(
            engine, prompts, flyspec_names, config, progress=args.progress, dataset=dataset
        )
        for summary in own["methods"]:
            summary["speedup_over_target"] = summary["speedup"]
            summary["speedup"] = _speedup_over(summary, own["samples"], vllm_target_speed)
        report["methods"] += own["methods"]
        report["samples"].update(own["samples"])
        report["config"]["flyspec"] = {
            "device": args.device,
            "dtype": args.dtype,
            "kernels": engine.kernels,
        }
    return _finish(args, report, config, output)


def _speedup_over(summary: dict, samples: dict, baseline_speed: list[float]) -> float | None:
    from flyspec.stats import mean_speedup

    speed = [r["tokens_per_second"] for r in samples[summary["method"]]]
    value = mean_speedup(speed, baseline_speed)
    return None if math.isnan(value) else round(value, 4)  # nan: no baseline


def _prompts(args: argparse.Namespace, tokenizer) -> tuple[list[BenchPrompt], str, bool]:
    """The prompts of --dataset or --prompts-file, their source's name, and whether they are
    chat prompts (default: when the tokenizer has a chat template)."""
    chat = args.chat
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if args.prompts_file:
        from flyspec.bench.prompts import read_prompts_file

        prompts = read_prompts_file(args.prompts_file, limit=args.limit, chat=chat)
        return prompts, Path(args.prompts_file).stem, chat
    from flyspec.bench.prompts import dataset_prompts

    return dataset_prompts(args.dataset, limit=args.limit, chat=chat), args.dataset, chat


def _finish(args: argparse.Namespace, report: dict, config, output: Path) -> int:
    """Write the report, warn where a lossless method differs from its baseline, print."""
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
                    "differ from its baseline's",
                    file=sys.stderr,
                )
    table = markdown_table(report["methods"], baseline=report["config"].get("baseline", "target"))
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        print(table, file=sys.stderr)
    else:
        print(table)
    for line in console_notes(report):
        print(f"flyspec: {line}", file=sys.stderr)
    if args.compare:
        from flyspec.bench.compare import format_comparison, read_bench

        print(format_comparison(read_bench(args.compare), report, old_name=args.compare))
    print(f"wrote {', '.join(files)} to {output}", file=sys.stderr)
    return 0


def console_notes(report: dict) -> list[str]:
    """What the console says under the table: the machine, its load (a warning when it was
    busy) and the prompts whose repeats disagree."""
    from flyspec.bench.report import machine_line, unstable_line
    from flyspec.machine import CpuLoad

    notes = [f"machine: {machine_line(report['environment'])}"]
    if report.get("machine_load"):
        load = CpuLoad.from_dict(report["machine_load"])
        notes.append(("warning: " if load.busy else "") + f"during the run {load.describe()}")
    unstable = unstable_line(report["methods"])
    if unstable:
        notes.append(f"warning: {unstable}")
    return notes


def run_benchmark(
    engine,
    prompts: Sequence[BenchPrompt],
    method_names: Sequence[str],
    config,
    *,
    progress: bool = True,
    dataset: str = "prompts",
    warmup: bool = True,
    repeats: int = 1,
) -> dict:
    """Run every method on every prompt, interleaved per prompt, ``repeats`` times; return the
    report (config, environment, what else used the CPU, per-method figures and per-sample
    records, every repeat's). ``config`` (a DecodeConfig) carries K, the FLy rule, sampling
    and ``max_new_tokens``; each method sets its own mode."""
    from tqdm import tqdm

    from flyspec.bench.prompts import encode_prompts
    from flyspec.bench.report import (
        decoding_settings,
        environment,
        sample_records,
        summarise_method,
    )
    from flyspec.machine import CpuMonitor, combined_load

    method_names = parse_methods(",".join(method_names))
    if not prompts:
        raise FlyspecError("no prompts to benchmark")
    if repeats < 1:
        raise FlyspecError(f"repeats must be >= 1, got {repeats}")
    methods = [make_method(name, engine, config) for name in method_names]
    prompt_ids = encode_prompts(engine.tokenizer, prompts)
    seed = config.sampling.seed

    def sample_seed(index: int) -> int | None:
        return None if seed is None else seed + index

    if warmup:
        warmup_tokens = min(config.max_new_tokens, 2 * (config.k + 1))
        for method in tqdm(methods, desc="warm-up", file=sys.stderr, disable=not progress):
            method.run(prompt_ids[0], max_new_tokens=warmup_tokens, seed=sample_seed(0))

    # runs[name][repeat][prompt]; each repeat runs every method once per prompt, the order
    # rotated by one method per repeat so that no method always runs first after another.
    runs: dict[str, list[list]] = {method.name: [[] for _ in range(repeats)] for method in methods}
    loads, orders = [], []
    bar = tqdm(
        total=repeats * len(prompts) * len(methods),
        desc="bench",
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        for repeat in range(repeats):
            order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
            orders.append([method.name for method in order])
            with CpuMonitor() as monitor:
                for index, ids in enumerate(prompt_ids):
                    for method in order:
                        bar.set_postfix_str(
                            f"{repeat + 1}/{repeats} {prompts[index].id} {method.name}",
                            refresh=False,
                        )
                        runs[method.name][repeat].append(
                            method.run(
                                ids,
                                max_new_tokens=config.max_new_tokens,
                                seed=sample_seed(index),
                            )
                        )
                        bar.update()
            loads.append(monitor.load)
    load = combined_load(loads)

    samples: dict[str, list[dict]] = {}
    summaries = []
    for method in methods:
        records = [
            record
            for repeat in range(repeats)
            for record in sample_records(
                prompts,
                prompt_ids,
                runs[method.name][repeat],
                runs["target"][repeat],
                decode=lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True),
                repeat=repeat,
            )
        ]
        samples[method.name] = records
        rounds = (
            [r for repeat in runs[method.name] for run in repeat for r in run.stats.rounds]
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
            **decoding_settings(config),
            "max_ngram": config.max_ngram,
            "mla_proposals": config.mla_proposals,
            "draft_confidence": config.draft_confidence,
            "target": engine.target_name,
            "draft": engine.draft_name,
            "warmup": warmup,
            "repeats": repeats,
            "method_order_per_repeat": orders,
            "timing": "wall time of each call (prefill included), interleaved per prompt; "
            "each repeat rotates the method order",
        },
        "environment": environment(),
        "machine_load": load.as_dict(),
        "machine_load_per_repeat": [one.as_dict() for one in loads],
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
            repeats=args.repeats or 5,
            forward_path=args.forward,
        )
    table = format_forward_cost(costs)
    report = {
        "config": {
            "k": config.k,
            "context_tokens": args.context_tokens,
            "repeats": args.repeats or 5,
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
