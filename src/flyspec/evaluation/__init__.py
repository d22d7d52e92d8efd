"""``flyspec eval``: accuracy recovery on real tasks and the speed/accuracy trade-off of FLy.

Runs HumanEval (pass@1, code executed in :mod:`flyspec.evaluation.sandbox`) and GSM8K (final
number) with the target alone, exact SPD and FLy at one or several (theta, W) settings on the
same problems, and reports score with Wilson intervals, recovery against the target, speedup,
tau and every problem whose outcome changed. Generations are cached on disk.

Modules: ``tasks`` (prompts, extraction, scoring), ``sandbox``, ``cache``, ``runner``,
``report``. Only argparse is imported here, so ``flyspec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TASKS = ("humaneval", "gsm8k")
DEFAULT_MODES = "target,spd,fly"


def add_parser(commands) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``flyspec``'s subparsers."""
    from flyspec import config as cfg
    from flyspec.cli import add_decode_arguments, add_model_arguments

    parser = commands.add_parser(
        "eval",
        help="accuracy recovery and speedup of FLy on HumanEval and GSM8K",
        description=(
            "Run the target alone, exact SPD and FLy (one or several theta/W settings) on the "
            "same HumanEval / GSM8K problems; report score (Wilson 95% CI), recovery vs the "
            "target (paired bootstrap CI), speedup, tau and every changed outcome. Writes "
            "eval.json, eval.md and tradeoff.png. Generations are cached: a rerun is free and "
            "an interrupted run resumes."
        ),
        conflict_handler="resolve",
    )
    add_model_arguments(parser)
    add_decode_arguments(parser)
    # Replace the single-valued decoding options by their list forms (and drop --mode).
    parser.add_argument(
        "--modes",
        "--mode",
        dest="modes",
        default=DEFAULT_MODES,
        help=f"comma-separated methods among {', '.join(cfg.MODES)} (default {DEFAULT_MODES})",
    )
    parser.add_argument(
        "--theta",
        default=str(cfg.DEFAULT_THETA),
        help="FLy entropy threshold(s), comma-separated, e.g. 0,0.3 (default 0.3); every "
        "(theta, window) combination is its own fly method",
    )
    parser.add_argument(
        "--window",
        default=str(cfg.DEFAULT_WINDOW),
        help="FLy deferred window(s) W, comma-separated, e.g. 0,4,6 (default 6)",
    )
    parser.add_argument(
        "--min-ratio",
        default="0",
        help="FLy plausibility floor(s): least target probability of the draft token relative "
        "to the target's top token, comma-separated, e.g. 0,0.1 (default 0: off)",
    )
    parser.add_argument(
        "--max-rank",
        default="0",
        help="FLy plausibility floor(s): the draft token among the target's top N, "
        "comma-separated (default 0: off)",
    )
    parser.add_argument(
        "--defer",
        default="off",
        help="FLy deferral across blocks: off, on, or off,on for both (default off)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="token budget per generation (default: humaneval 384, gsm8k 384)",
    )
    parser.add_argument(
        "--task",
        action="append",
        default=None,
        help="humaneval and/or gsm8k, comma-separated or repeated (default: both)",
    )
    parser.add_argument(
        "--limit",
        default=None,
        help="first N problems of each task, or per task as humaneval=N,gsm8k=M; START:END "
        "takes problems START to END-1, e.g. humaneval=40:100 (default: humaneval 40, gsm8k 40)",
    )
    parser.add_argument(
        "--prompt-style",
        default="auto",
        choices=("auto", "chat", "raw"),
        help="chat template or raw completion prompts (default auto: chat when the "
        "tokenizer has a template)",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="output folder (default results/eval-<time>)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="generation cache folder (default $FLYSPEC_HOME/eval-cache)",
    )
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    parser.add_argument(
        "--exec-timeout",
        type=float,
        default=10.0,
        help="wall-clock limit per HumanEval program, seconds (default 10)",
    )
    parser.add_argument(
        "--exec-memory-mb",
        type=int,
        default=1024,
        help="memory budget per HumanEval run, all its processes together (and address-space "
        "limit of each), MiB (default 1024)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_eval)
    return parser


def _split(values: list[str] | str | None) -> list[str]:
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _numbers(text: str, kind, option: str) -> list:
    from flyspec.errors import FlyspecError

    items = _split(text)
    if not items:
        raise FlyspecError(f"{option} needs at least one value")
    try:
        return [kind(item) for item in items]
    except ValueError:
        raise FlyspecError(f"{option}: not a list of numbers: {text!r}") from None


def _limits(text: str | None) -> dict[str, tuple[int, int]]:
    """``"40"`` -> every task (0, 40); ``"humaneval=40,gsm8k=10:50"`` -> per task (key ``*`` =
    all): the problems ``start`` to ``end - 1``."""
    from flyspec.errors import FlyspecError

    limits: dict[str, tuple[int, int]] = {}
    for item in _split(text):
        name, _, value = item.rpartition("=")
        name = name.strip() or "*"
        if name != "*" and name not in TASKS:
            raise FlyspecError(f"--limit: unknown task {name!r}; choose from {', '.join(TASKS)}")
        start, _, end = value.rpartition(":")
        try:
            bounds = (int(start or 0), int(end))
        except ValueError:
            raise FlyspecError(f"--limit: not a number or START:END: {value!r}") from None
        if bounds[0] < 0 or bounds[1] <= bounds[0]:
            raise FlyspecError(f"--limit must take at least one problem, got {value!r}")
        limits[name] = bounds
    return limits


def _switches(text: str) -> list[bool]:
    from flyspec.errors import FlyspecError

    values = {"off": False, "on": True}
    items = _split(text)
    if not items or any(item not in values for item in items):
        raise FlyspecError(f"--defer takes off, on or off,on, got {text!r}")
    return [values[item] for item in items]


def run_eval(args: argparse.Namespace, *, problems: dict | None = None) -> int:
    """The ``eval`` handler. ``problems`` (task name -> list of problems) replaces the
    datasets, for tests and custom problem sets."""
    from flyspec import config as cfg
    from flyspec.cli import decode_config_from_args, load_engine
    from flyspec.errors import FlyspecError
    from flyspec.evaluation import loosening, report
    from flyspec.evaluation.cache import GenerationCache, decoding_identity, default_cache_dir
    from flyspec.evaluation.runner import TaskRun, build_methods, evaluate
    from flyspec.evaluation.tasks import load_problems, make_task

    task_names = list(dict.fromkeys(_split(args.task))) or list(TASKS)
    for name in task_names:
        if name not in TASKS:
            raise FlyspecError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    modes = list(dict.fromkeys(_split(args.modes)))
    for mode in modes:
        if mode not in cfg.MODES:
            raise FlyspecError(f"unknown mode {mode!r}; choose from {', '.join(cfg.MODES)}")
    if not modes:
        raise FlyspecError("--modes needs at least one method")
    rules = {
        "theta": _numbers(args.theta, float, "--theta"),
        "window": _numbers(args.window, int, "--window"),
        "min_ratio": _numbers(args.min_ratio, float, "--min-ratio"),
        "max_rank": _numbers(args.max_rank, int, "--max-rank"),
        "defer": _switches(args.defer),
    }
    limits = _limits(args.limit)
    if args.exec_timeout <= 0 or args.exec_memory_mb <= 0:
        raise FlyspecError("--exec-timeout and --exec-memory-mb must be positive")

    base = decode_config_from_args(
        argparse.Namespace(
            **{
                **vars(args),
                "mode": "fly",
                **{name: values[0] for name, values in rules.items()},
                "max_new_tokens": args.max_new_tokens or 1,
                "stop": list(args.stop),
            }
        )
    )
    methods = build_methods(modes, base.fly, rules)  # every combination validated

    sandbox = None
    if "humaneval" in task_names:
        from flyspec.evaluation.sandbox import sandbox_info

        # Before anything is written or loaded: a bad FLYSPEC_SANDBOX is a one-line error.
        sandbox = sandbox_info().as_dict()
        _say(
            f"sandbox for HumanEval programs: {sandbox['backend']}, run-wide limits by "
            f"{sandbox['run_limits']} ({sandbox['interpreter']})"
        )
        for note in sandbox["notes"]:
            _say(f"  note: {note}")

    runs = []
    for name in task_names:
        task = make_task(name, timeout_s=args.exec_timeout, memory_mb=args.exec_memory_mb)
        start, end = limits.get(name, limits.get("*", (0, task.default_limit)))
        if problems is not None:
            chosen = list(problems.get(name, []))[start:end]
        else:
            chosen = list(load_problems(name, end))[start:]
        max_new_tokens = args.max_new_tokens or task.default_max_new_tokens
        runs.append(TaskRun(task=task, problems=chosen, max_new_tokens=max_new_tokens, first=start))

    output = args.output or Path("results") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    output.mkdir(parents=True, exist_ok=True)
    cache = GenerationCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))

    with_draft = any(m.config(base).uses_draft_model for m in methods)
    engine = load_engine(args, with_draft=with_draft)
    if args.prompt_style == "auto":
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
    else:
        chat = args.prompt_style == "chat"
        if chat and not getattr(engine.tokenizer, "chat_template", None):
            raise FlyspecError("--prompt-style chat: this tokenizer has no chat template")

    started = time.perf_counter()
    samples = evaluate(
        engine,
        runs,
        methods,
        base,
        cache=cache,
        chat=chat,
        progress=not args.no_progress,
    )
    elapsed = time.perf_counter() - started

    from flyspec.evaluation.runner import EngineIdentity

    identity = EngineIdentity.of(engine)
    payload = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["flyspec", *sys.argv[1:]]) if sys.argv else "flyspec eval",
        "seconds": round(elapsed, 2),
        "models": {
            "target": identity.target,
            "draft": identity.draft,
            "dtype": identity.dtype,
            "device": identity.device,
        },
        "settings": {
            "tasks": {
                run.task.name: {
                    "problems": len(run.problems),
                    "range": [run.first, run.first + len(run.problems)],
                    "max_new_tokens": run.max_new_tokens,
                    "version": run.task.version,
                }
                for run in runs
            },
            "methods": [m.as_dict() for m in methods],
            "decoding": decoding_identity(base.with_updates(max_new_tokens=1)),
            "decoding_summary": _decoding_summary(base),
            "prompt_style": "chat template" if chat else "raw",
            "exec_timeout_s": args.exec_timeout,
            "exec_memory_mb": args.exec_memory_mb,
        },
        "sandbox": sandbox,
        "cache": {
            "dir": None if cache.folder is None else str(cache.folder),
            "hits": cache.hits,
            "misses": cache.misses,
            "note": "cached generations keep the timing statistics of the run that produced "
            "them; speedup and tokens/s are computed from those",
        },
        "tasks": report.summarize(samples, methods, task_names),
        "loosening": loosening.analyse(samples, methods, task_names),
        "samples": [s.as_dict() for s in samples],
    }
    if report.plot_tradeoff(output / "tradeoff.png", payload):
        payload["plot"] = "tradeoff.png"
    if loosening.plot(output / "loosening.png", payload["loosening"]):
        payload["loosening_plot"] = "loosening.png"
    report.write_json(output / "eval.json", payload)
    markdown = report.render_markdown(payload)
    (output / "eval.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    _say(
        f"done in {elapsed:.0f}s ({cache.hits} cached, {cache.misses} generated); "
        f"results in {output}/ (eval.json, eval.md"
        f"{', tradeoff.png' if 'plot' in payload else ''}"
        f"{', loosening.png' if 'loosening_plot' in payload else ''})"
    )
    return 0


def _decoding_summary(base) -> str:
    sampling = base.sampling
    how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    return f"{how}, drafter {base.drafter}, K={base.k}, entropy {base.fly.entropy}" + (
        f", extra stop strings {list(base.stop)}" if base.stop else ""
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
