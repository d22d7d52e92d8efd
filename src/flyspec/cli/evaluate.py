"""``flyspec eval``: accuracy recovery and speed of FLy on HumanEval and GSM8K
(:mod:`flyspec.evaluation`), with lists of FLy settings compared in one run."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flyspec import config as cfg
from flyspec.cli.options import (
    PROMPT_STYLE_CHAT,
    Option,
    add_backend_arguments,
    add_chat_argument,
    add_decode_arguments,
    add_model_arguments,
    add_option,
    add_vllm_arguments,
    decode_config_from_args,
    load_engine,
    max_tokens_option,
    say,
    vllm_engine_spec,
)
from flyspec.errors import FlyspecError
from flyspec.evaluation.run import DEFAULT_TASKS, TASKS

DEFAULT_MODES = "target,spd,fly"


PAPER_RULE = {
    "theta": str(cfg.DEFAULT_THETA),
    "window": str(cfg.DEFAULT_WINDOW),
    "min_ratio": "0",
    "max_rank": "0",
    "max_draft_confidence": "1",
    "defer": "off",
}
"""The FLy rule ``flyspec eval`` measures unless told otherwise: the paper's default."""


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``eval`` to the ``flyspec`` subcommands."""
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
    )
    add_evaluation_arguments(
        parser, rules=PAPER_RULE, limit="humaneval 40, gsm8k 40", modes=DEFAULT_MODES
    )
    parser.set_defaults(handler=run_eval)
    return parser


def add_evaluation_arguments(
    parser: argparse.ArgumentParser,
    *,
    rules: dict[str, str],
    limit: str,
    modes: str | None = None,
) -> None:
    """The options ``eval`` and ``calibrate`` share: models, decoding, the FLy rules as lists
    (``rules``: their defaults; every combination is its own FLy method), tasks, problems
    (``limit``: the default's description), output, cache and sandbox limits; ``modes``: the
    default of --modes, the methods compared (None: the command fixes them, no option).

    The lists have plural names (--modes, --thetas, --defers, ...); their singular names, which
    mean one value in the other commands, are kept as hidden aliases that still read a list."""
    add_model_arguments(parser)
    tasks = parser.add_argument_group("tasks")
    add_option(
        tasks,
        "--tasks",
        aliases=("--task",),
        dest="task",
        action="append",
        default=None,
        help="humaneval, humaneval-edit (edits of working code, with Predicted Outputs) and/or "
        "gsm8k, comma-separated or repeated (default: humaneval and gsm8k)",
    )
    tasks.add_argument(
        "--limit",
        default=None,
        help="first N problems of each task, or per task as humaneval=N,gsm8k=M; START:END "
        f"takes problems START to END-1, e.g. humaneval=40:100 (default: {limit})",
    )
    add_chat_argument(
        tasks,
        default=None,
        help="chat template or raw completion prompts (default: chat when the tokenizer has "
        "a template)",
        prompt_style_alias=True,
    )
    lists: dict[str, Option] = {
        "theta": _rule_list(
            "theta",
            rules,
            "FLy entropy thresholds, comma-separated, e.g. 0,0.3 (default {}); every "
            "combination of the rule's settings is its own fly method",
        ),
        "window": _rule_list(
            "window", rules, "FLy deferred windows W, comma-separated, e.g. 0,4,6 (default {})"
        ),
        "min_ratio": _rule_list(
            "min_ratio",
            rules,
            "plausibility floors: least target probability of the draft token relative to the "
            "target's top token, comma-separated, e.g. 0,0.1 (default {}; 0: off)",
        ),
        "max_rank": _rule_list(
            "max_rank",
            rules,
            "plausibility floors: the draft token among the target's top N, comma-separated "
            "(default {}; 0: off)",
        ),
        "max_draft_confidence": _rule_list(
            "max_draft_confidence",
            rules,
            "the draft's doubt: loosen only where the draft model gave its own token at most "
            "this probability, comma-separated, e.g. 1,0.5 (default {}; 1: off)",
        ),
        "defer": _rule_list(
            "defer", rules, "deferral across blocks: off, on, or off,on for both (default {})"
        ),
        "max_new_tokens": max_tokens_option(
            default=None,
            help="token budget per generation (default: humaneval 384, humaneval-edit 512, "
            "gsm8k 384)",
        ),
    }
    if modes is not None:
        lists["mode"] = (
            ("--modes",),
            dict(
                aliases=("--mode",),
                dest="modes",
                default=modes,
                help=f"comma-separated methods among {', '.join(cfg.MODES)} (default {modes})",
            ),
        )
    add_decode_arguments(parser, leave_out=("mode", "no_calibration"), replace=lists)
    output = parser.add_argument_group("output, cache and sandbox")
    output.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"output folder (default results/{parser.prog.split()[-1]}-<time>)",
    )
    output.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="generation cache folder (default $FLYSPEC_HOME/eval-cache)",
    )
    output.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    output.add_argument(
        "--exec-timeout",
        type=float,
        default=10.0,
        help="wall-clock limit per HumanEval program, seconds (default 10)",
    )
    output.add_argument(
        "--exec-memory-mb",
        type=int,
        default=1024,
        help="memory budget per HumanEval run, all its processes together (and address-space "
        "limit of each), MiB (default 1024)",
    )
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_backend_arguments(parser)
    add_vllm_arguments(parser)


def _rule_list(dest: str, rules: dict[str, str], help: str) -> Option:
    """A FLy rule option as a list: its name in the plural, the singular (one value in the
    other commands) kept as a hidden alias; ``help`` with ``{}`` for the default."""
    flag = "--" + dest.replace("_", "-")
    settings = dict(aliases=(flag,), dest=dest, default=rules[dest], help=help.format(rules[dest]))
    return (f"{flag}s",), settings


def _split(values: list[str] | str | None) -> list[str]:
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _numbers(text: str, kind, option: str) -> list:
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
    values = {"off": False, "on": True}
    items = _split(text)
    if not items or any(item not in values for item in items):
        raise FlyspecError(f"--defers takes off, on or off,on, got {text!r}")
    return [values[item] for item in items]


def evaluation_settings(args: argparse.Namespace, modes: list[str], *, limit: str | None = None):
    """``(EvalSettings, base DecodeConfig)`` from the options of :func:`add_evaluation_arguments`
    and the methods' ``modes``; ``limit`` replaces an absent --limit."""
    from flyspec.evaluation.cache import default_cache_dir
    from flyspec.evaluation.run import EvalSettings
    from flyspec.evaluation.runner import build_methods

    for mode in modes:
        if mode not in cfg.MODES:
            raise FlyspecError(f"unknown mode {mode!r}; choose from {', '.join(cfg.MODES)}")
    if not modes:
        raise FlyspecError("--modes needs at least one method")
    rules = {
        "theta": _numbers(args.theta, float, "--thetas"),
        "window": _numbers(args.window, int, "--windows"),
        "min_ratio": _numbers(args.min_ratio, float, "--min-ratios"),
        "max_rank": _numbers(args.max_rank, int, "--max-ranks"),
        "max_draft_confidence": _numbers(
            args.max_draft_confidence, float, "--max-draft-confidences"
        ),
        "defer": _switches(args.defer),
    }
    base = decode_config_from_args(
        args,
        mode="fly",
        max_new_tokens=args.max_new_tokens or 1,
        **{name: values[0] for name, values in rules.items()},
    )
    settings = EvalSettings(
        tasks=list(dict.fromkeys(_split(args.task))) or list(DEFAULT_TASKS),
        methods=build_methods(modes, base.fly, rules),  # every combination validated
        limits=_limits(args.limit or limit),
        max_new_tokens=args.max_new_tokens,
        prompt_style=next(style for style, chat in PROMPT_STYLE_CHAT.items() if chat is args.chat),
        cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()),
        exec_timeout_s=args.exec_timeout,
        exec_memory_mb=args.exec_memory_mb,
        progress=not args.no_progress,
    )
    return settings, base


def output_folder(args: argparse.Namespace, name: str) -> Path:
    """--output, or ``results/<name>-<time>``."""
    return args.output or Path("results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def command_line(name: str) -> str:
    """The command as typed, recorded as the command that reproduces a run."""
    return " ".join(["flyspec", *sys.argv[1:]]) if sys.argv else f"flyspec {name}"


def evaluation_vllm_spec(args: argparse.Namespace, settings, base: cfg.DecodeConfig):
    """The vLLM engine of ``--engine vllm`` (None for flyspec's own engine), every FLy method
    checked against it before anything loads."""
    if args.engine != "vllm":
        return None
    from dataclasses import replace

    spec = vllm_engine_spec(args, base, mode="fly")
    for method in settings.methods:
        if method.mode == "fly":
            # Each refuses a rule this vLLM's FLy cannot run: vLLM's own, or the plugin.
            replace(spec, fly=method.fly).additional_config()
    return spec


def run_eval(args: argparse.Namespace, *, problems: dict | None = None) -> int:
    """The ``eval`` handler. ``problems`` (task name -> list of problems) replaces the
    datasets, for tests and custom problem sets."""
    from flyspec.evaluation.run import run_evaluation

    settings, base = evaluation_settings(args, list(dict.fromkeys(_split(args.modes))))
    output = output_folder(args, "eval")
    payload = run_evaluation(
        settings,
        base,
        load_engine=lambda with_draft: load_engine(args, with_draft=with_draft),
        output=output,
        command=command_line("eval"),
        problems=problems,
        vllm_spec=evaluation_vllm_spec(args, settings, base),
    )
    print((output / "eval.md").read_text(encoding="utf-8"))
    for name, engine in (payload.get("vllm_engines") or {}).items():
        say(
            f"vLLM {name}: {engine['generations']} in flight, {engine['wall_seconds']:.0f}s "
            f"({engine['tokens_per_second']} tok/s), engine start {engine['engine_start_seconds']}s"
            + (f", tau {engine['tau']}" if engine.get("tau") else "")
        )
    cache = payload["cache"]
    files = ["eval.json", "eval.md"] + [
        payload[name] for name in ("plot", "loosening_plot") if name in payload
    ]
    say(
        f"done in {payload['seconds']:.0f}s ({cache['hits']} cached, {cache['misses']} "
        f"generated); results in {output}/ ({', '.join(files)})"
    )
    return 0
