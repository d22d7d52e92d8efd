"""``flyspec bench``: speed of flyspec's methods and transformers' peers side by side, of vLLM's
methods (``--engine vllm``), of one method against the target alone on one prompt
(``--prompt``, the quick start's), or the cost of a multi-token forward (``--forward-cost``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from flyspec.bench.methods import (
    ALL_METHODS,
    DEFAULT_METHODS,
    DEFAULT_VLLM_METHODS,
    FLYSPEC_METHODS,
    GGUF_METHODS,
    LLAMA_SERVER_METHOD_NAMES,
    LLAMACPP_LOOP_METHODS,
    LLAMACPP_METHODS_NEEDING_DRAFT,
    METHODS_NEEDING_DRAFT,
    VLLM_METHOD_NAMES,
    method_base,
    parse_methods,
)
from flyspec.bench.one_prompt import DEFAULT_PAIRS
from flyspec.bench.prompts import DATASET_NAMES, BenchPrompt
from flyspec.cli.options import (
    add_backend_arguments,
    add_chat_argument,
    add_decode_arguments,
    add_model_arguments,
    add_vllm_arguments,
    decode_config_from_args,
    dtype_name,
    forward_threads,
    load_engine,
    say,
    vllm_engine_spec,
)
from flyspec.errors import FlyspecError


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``flyspec`` subcommands."""
    bench = commands.add_parser(
        "bench",
        help="measure speed: flyspec's methods and transformers' peers side by side",
        description="Measure the speed of flyspec's methods and transformers' peers on the same "
        "models and prompts, interleaved per prompt; or (--prompt) one method against the target "
        "alone and llama.cpp's plain decoding on one prompt; or (--forward-cost) the cost of a "
        "multi-token forward relative to a one-token forward.",
    )
    add_model_arguments(bench)
    runs = bench.add_argument_group("what runs")
    runs.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, from {', '.join(ALL_METHODS)} "
        f"(default: {','.join(DEFAULT_METHODS)}; with --engine vllm: "
        f"{','.join(DEFAULT_VLLM_METHODS)}); the baseline (target, or vllm-target with "
        "--engine vllm) is always included",
    )
    source = runs.add_mutually_exclusive_group()
    source.add_argument(
        "--dataset", default="humaneval", choices=DATASET_NAMES, help="default: humaneval"
    )
    source.add_argument(
        "--prompts-file",
        help='JSONL file, one {"prompt": ..., "id": ...} per line, instead of a dataset',
    )
    source.add_argument(
        "--prompt",
        metavar="TEXT",
        help="instead: this one prompt ('-' reads standard input), --methods' one method of "
        "flyspec's decoder (default fly) timed alternately with the target alone and, where "
        "the target's GGUF file is known, llama.cpp's plain decoding of it (by llama-server "
        "where it is built, by the binding where it is installed); the method's last answer "
        "streamed, then the speedup and whether the machine was quiet enough to trust it",
    )
    runs.add_argument(
        "--limit", type=int, default=None, help=f"number of prompts (default {DEFAULT_LIMIT})"
    )
    runs.add_argument(
        "--prediction",
        metavar="FILE",
        help="with --prompt: a file holding text the answer is expected to largely repeat "
        "('-' reads standard input), which the *predict methods draft from (Predicted Outputs)",
    )
    add_chat_argument(
        runs, default=None, help="apply the chat template (default: when the tokenizer has one)"
    )
    runs.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved passes over what is timed: over the prompts, each running every "
        "method once per prompt in a rotated order (default 1; speeds and speedups are then "
        "medians with their range); with --prompt, alternated runs of the target alone and "
        f"the method (default {DEFAULT_PAIRS}); or with --forward-cost over the forward "
        "sizes, each timing every n once (default 5)",
    )
    # Each method fixes its mode and drafter; stop strings and draft sampling do not apply.
    add_decode_arguments(bench, leave_out=("mode", "drafter", "stop", "draft_temperature"))
    output = bench.add_argument_group("output")
    output.add_argument(
        "--output", help="output folder (default: results/bench-<dataset>-<timestamp>)"
    )
    shown = output.add_mutually_exclusive_group()
    shown.add_argument(
        "--json",
        action="store_true",
        help="print the JSON report on stdout instead of the table (which goes to stderr), "
        "as generate --json prints its result instead of the text; with --prompt, "
        "generate --json's object with the comparison's figures",
    )
    shown.add_argument(
        "--show",
        action="store_true",
        help="with --prompt: colour each token of the answer by how it was obtained (exact, "
        "loose, correction, bonus), as generate --show",
    )
    output.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    output.add_argument(
        "--compare",
        metavar="OLD_BENCH_JSON",
        help="after the run, print each method's new/old speed ratio against this earlier "
        "bench.json, marking changes larger than the noise",
    )
    add_backend_arguments(bench)
    cost = bench.add_argument_group("forward cost")
    cost.add_argument(
        "--forward-cost",
        action="store_true",
        help="instead: time one forward over n = 1..K+1 new tokens on each model",
    )
    cost.add_argument(
        "--context-tokens", type=int, default=200, help="KV cache length (default 200)"
    )
    vllm = add_vllm_arguments(bench)
    vllm.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="with --engine vllm: also measure each vLLM method's throughput with this many "
        "requests in flight (default 1: batch 1 only)",
    )
    bench.set_defaults(handler=run_bench)
    return bench


def add_compare_parser(commands) -> argparse.ArgumentParser:
    """Add ``compare`` (two finished bench runs side by side) to the ``flyspec`` subcommands."""
    compare = commands.add_parser(
        "compare",
        help="compare two flyspec bench runs",
        description="Compare two flyspec bench runs (bench.json files or their folders): each "
        "method's new/old speed ratio, marking changes larger than the noise.",
    )
    compare.add_argument("old", help="the earlier bench.json or its folder")
    compare.add_argument("new", help="the later bench.json or its folder")
    compare.set_defaults(handler=run_compare)
    return compare


def run_compare(args: argparse.Namespace) -> int:
    from flyspec.bench.compare import format_comparison, read_bench

    old, new = read_bench(args.old), read_bench(args.new)
    print(format_comparison(old, new, old_name=args.old))
    return 0


DEFAULT_LIMIT = 10
"""Prompts of a dataset or file where --limit does not say."""

ONE_PROMPT_ONLY = ("prediction", "show")
"""The options of --prompt alone, by destination."""
NOT_WITH_ONE_PROMPT = ("limit", "output", "compare", "forward_cost")
"""The options --prompt has no use for, by destination (their defaults are None or False)."""


def _check_args(args: argparse.Namespace) -> None:
    if args.prompt is None:
        given = [name for name in ONE_PROMPT_ONLY if getattr(args, name)]
        if given:
            raise FlyspecError(f"--{given[0].replace('_', '-')} is for --prompt")
    else:
        given = [name for name in NOT_WITH_ONE_PROMPT if getattr(args, name)]
        if args.engine == "vllm":
            given.append("engine vllm")
        if given:
            raise FlyspecError(f"--prompt times one prompt: drop --{given[0].replace('_', '-')}")
    if args.limit is not None and args.limit < 1:
        raise FlyspecError(f"--limit must be >= 1, got {args.limit}")
    forward_threads(args)
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
    if args.backend == "llamacpp" and not args.forward_cost:
        raise FlyspecError(
            "bench runs llama.cpp through its llamacpp-* methods (e.g. --methods "
            "llamacpp-target,llamacpp-fly,target,fly, or --methods llamacpp-fly with --prompt); "
            "--backend llamacpp is for --forward-cost"
        )


def run_bench(args: argparse.Namespace) -> int:
    from flyspec.bench import run_benchmark

    _check_args(args)
    if args.prompt is not None:
        return _run_one_prompt(args)
    vllm_engine = args.engine == "vllm"
    requested = args.methods or ",".join(DEFAULT_VLLM_METHODS if vllm_engine else DEFAULT_METHODS)
    baseline = _baseline(requested, vllm_engine=vllm_engine)
    methods = parse_methods(requested, baseline=baseline)
    in_vllm = [name for name in methods if name in VLLM_METHOD_NAMES]
    if in_vllm and not vllm_engine:
        raise FlyspecError(f"{', '.join(in_vllm)} run in vLLM: add --engine vllm")
    config = decode_config_from_args(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.forward_cost:
        output = Path(args.output or f"results/forward-cost-{stamp}")
        return _run_forward_cost(args, config, output)

    if vllm_engine:
        return _run_vllm_bench(args, methods, config, stamp)

    bases = {method_base(name) for name in methods}
    on_gguf = bases & set(GGUF_METHODS)
    engine = llamacpp_engine = None
    if bases - on_gguf:
        engine = load_engine(args, with_draft=bool(METHODS_NEEDING_DRAFT & bases))
    if on_gguf:
        llamacpp_engine = load_engine(
            args, with_draft=bool(LLAMACPP_METHODS_NEEDING_DRAFT & bases), backend="llamacpp"
        )
    prompts, dataset, chat = _prompts(args, (engine or llamacpp_engine).tokenizer)
    output = Path(args.output or f"results/bench-{dataset}-{stamp}")

    report = run_benchmark(
        engine,
        prompts,
        methods,
        config,
        progress=args.progress,
        dataset=dataset,
        repeats=args.repeats or 1,
        llamacpp_engine=llamacpp_engine,
        baseline=baseline,
    )
    report["config"].update(
        device=args.device,
        dtype=dtype_name(args),
        chat=chat,
        kernels=None if engine is None else engine.kernels,
    )
    return _finish(args, report, output)


def _baseline(requested: str, *, vllm_engine: bool) -> str:
    """The method every speedup is over: vllm-target with --engine vllm; when only methods on
    the GGUF files run, llama.cpp's plain decoding, by its server where one of its methods is
    asked for, else by its binding; else flyspec's target."""
    if vllm_engine:
        return "vllm-target"
    bases = [method_base(name.strip()) for name in requested.split(",") if name.strip()]
    if bases and all(base in GGUF_METHODS for base in bases):
        if any(base in LLAMA_SERVER_METHOD_NAMES for base in bases):
            return "llama-server"
        return "llamacpp-target"
    return "target"


def _run_vllm_bench(args: argparse.Namespace, methods: list[str], config, stamp: str) -> int:
    """vLLM's methods one engine after another, then flyspec's own (interleaved), in one
    report whose speedups are over vllm-target."""
    from flyspec.bench import add_flyspec_methods, run_benchmark
    from flyspec.bench.vllm import run_vllm_benchmark
    from flyspec.models import load_tokenizer

    if not config.sampling.greedy and config.sampling.seed is None:
        config = config.with_updates(sampling=replace(config.sampling, seed=0))
    spec = vllm_engine_spec(args, config, mode="fly")
    tokenizer = load_tokenizer(spec.target)
    prompts, dataset, chat = _prompts(args, tokenizer)
    output = Path(args.output or f"results/bench-{dataset}-vllm-{stamp}")
    report = run_vllm_benchmark(
        spec,
        [name for name in methods if name in VLLM_METHOD_NAMES],
        prompts,
        tokenizer,
        config,
        concurrency=args.concurrency,
        progress=args.progress,
        dataset=dataset,
        chat=chat,
    )
    report["config"]["methods"] = methods
    flyspec_names = [name for name in methods if name not in VLLM_METHOD_NAMES]
    if flyspec_names:
        engine = load_engine(
            args, with_draft=bool(METHODS_NEEDING_DRAFT.intersection(flyspec_names))
        )
        own = run_benchmark(
            engine, prompts, flyspec_names, config, progress=args.progress, dataset=dataset
        )
        add_flyspec_methods(
            report,
            own,
            engine_settings={
                "device": args.device,
                "dtype": dtype_name(args),
                "kernels": engine.kernels,
            },
        )
    return _finish(args, report, output)


def _prompts(args: argparse.Namespace, tokenizer) -> tuple[list[BenchPrompt], str, bool]:
    """The prompts of --dataset or --prompts-file, their source's name, and whether they are
    chat prompts (default: when the tokenizer has a chat template)."""
    chat = args.chat
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    limit = args.limit or DEFAULT_LIMIT
    if args.prompts_file:
        from flyspec.bench.prompts import read_prompts_file

        prompts = read_prompts_file(args.prompts_file, limit=limit, chat=chat)
        return prompts, Path(args.prompts_file).stem, chat
    from flyspec.bench.prompts import dataset_prompts

    return dataset_prompts(args.dataset, limit=limit, chat=chat), args.dataset, chat


def _finish(args: argparse.Namespace, report: dict, output: Path) -> int:
    """Write the report, warn where a lossless method differs from its baseline, print."""
    from flyspec.bench import console_notes, lossless_warnings
    from flyspec.bench.report import markdown_table, write_report

    files = write_report(report, output)
    for warning in lossless_warnings(report):
        print(f"flyspec: warning: {warning}", file=sys.stderr)
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
    return 1 if report.get("failed_methods") else 0


def _run_forward_cost(args: argparse.Namespace, config, output: Path) -> int:
    from flyspec.bench.forward_cost import format_forward_cost, measure_forward_cost
    from flyspec.bench.report import environment

    engine = load_engine(args, with_draft=True)
    kernels = engine.kernels
    if engine.backend == "llamacpp":
        models = {"draft": engine.decoder.draft, "target": engine.decoder.target}
    else:
        models = {"draft": engine.draft_model, "target": engine.target_model}
    costs = {}
    for role, model in models.items():
        print(f"timing the {role} ...", file=sys.stderr, flush=True)
        costs[role] = measure_forward_cost(
            model,
            max_new_tokens=config.k + 1,
            context_tokens=args.context_tokens,
            repeats=args.repeats or 5,
            forward_path="llamacpp" if engine.backend == "llamacpp" else args.forward,
        )
    table = format_forward_cost(costs)
    report = {
        "config": {
            "k": config.k,
            "context_tokens": args.context_tokens,
            "repeats": args.repeats or 5,
            "target": engine.target_name,
            "draft": engine.draft_name,
            "dtype": dtype_name(args),
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


def _run_one_prompt(args: argparse.Namespace) -> int:
    """--prompt: one method of flyspec's decoder timed alternately with the target alone and
    llama.cpp's plain decoding (:class:`~flyspec.bench.one_prompt.TargetComparison`); its
    last answer streamed (or --json's object), then the comparison's lines."""
    from flyspec.bench.methods import method_config, uses_prediction
    from flyspec.bench.one_prompt import TargetComparison, plain_llamacpp_peers
    from flyspec.cli.generate import json_result, read_prompt_and_prediction, stream_answer

    name = _one_method(args.methods or "fly")
    if uses_prediction(name) and args.prediction is None:
        raise FlyspecError(f"{name} drafts from a prediction: give --prediction FILE")
    if args.prediction is not None and not uses_prediction(name):
        raise FlyspecError(
            f"{name} drafts from no prediction: --prediction is for the *predict methods"
        )
    config = method_config(name, decode_config_from_args(args))
    prompt, prediction = read_prompt_and_prediction(args.prompt, args.prediction)
    backend = "llamacpp" if method_base(name) in LLAMACPP_LOOP_METHODS else "torch"
    engine = load_engine(args, with_draft=config.uses_draft_model, backend=backend)
    prompt_ids = engine.encode(prompt, chat=args.chat)
    prediction_ids = None if prediction is None else engine.encode_prediction(prediction)
    peers = plain_llamacpp_peers(
        engine,
        config,
        default_target=args.target is None,
        threads=forward_threads(args),
        context=args.llamacpp_context,
    )
    comparison = TargetComparison(pairs=args.repeats or DEFAULT_PAIRS, label=name, peers=peers)
    try:
        comparison.start(engine, prompt_ids, config, prediction=prediction_ids)
        if args.json:
            result = engine.generate(prompt_ids, config, prediction=prediction_ids)
            print(json_result(result, **comparison.finish(result.stats)))
            return 0
        stats = stream_answer(
            engine, prompt_ids, config, label=name, show=args.show, prediction=prediction_ids
        )
        comparison.finish(stats)
        say(comparison.line())
        return 0
    finally:
        comparison.close()


def _one_method(text: str) -> str:
    """--methods with --prompt: one method of flyspec's decoder, on either engine, other than
    the target alone (which the comparison runs by itself)."""
    decoding = [
        name
        for name in (*FLYSPEC_METHODS, *LLAMACPP_LOOP_METHODS)
        if FLYSPEC_METHODS[LLAMACPP_LOOP_METHODS.get(name, name)][0] != "target"
    ]
    names = [name.strip() for name in text.split(",") if name.strip()]
    if len(names) != 1 or method_base(names[0]) not in decoding:
        raise FlyspecError(
            "--prompt times one method of flyspec's decoder against the target alone: give "
            f"--methods one of {', '.join(decoding)} (maybe with @K), got {text!r}"
        )
    return parse_methods(names[0], baseline=names[0])[0]  # @K checked
