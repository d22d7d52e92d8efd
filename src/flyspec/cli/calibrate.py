"""``flyspec calibrate``: the loosest FLy rule that keeps the target's accuracy on this pair,
saved as the pair's default (:mod:`flyspec.calibration`)."""

from __future__ import annotations

import argparse

from flyspec.cli.evaluate import (
    add_evaluation_arguments,
    command_line,
    evaluation_settings,
    evaluation_vllm_spec,
    output_folder,
)
from flyspec.cli.options import load_engine, number, say
from flyspec.errors import FlyspecError

GRID = {
    "theta": "0.3,0.5,1",
    "window": "4,6",
    "min_ratio": "0,0.1",
    "max_rank": "0",
    "max_draft_confidence": "1",
    "defer": "off",
}
"""The rules tried by default: 12, from the paper's default to a near-exact one."""

CALIBRATION_SPLIT = "humaneval=40,gsm8k=50"
DEFAULT_MIN_RECOVERY = 99.0


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``calibrate`` to the ``flyspec`` subcommands."""
    parser = commands.add_parser(
        "calibrate",
        help="find the loosest FLy rule that keeps the target's accuracy on this pair",
        description=(
            "Evaluate a grid of FLy rules against the target alone on a calibration split "
            "(as `flyspec eval` does, with its cache), keep the rules whose recovery is at "
            "least --min-recovery on every task, and save the one with the most tokens per "
            "round as this pair's FLy default: generate, bench and serve then start from it. "
            "Writes eval.json, eval.md and calibration.md. Each rule costs one FLy generation "
            "per problem, the target one more."
        ),
    )
    choice = parser.add_argument_group("the choice")
    choice.add_argument(
        "--min-recovery",
        type=number,
        default=DEFAULT_MIN_RECOVERY,
        help="percent of the target's score a rule must keep on every task (default 99)",
    )
    choice.add_argument(
        "--no-save",
        action="store_true",
        help="report the choice without making it the pair's default",
    )
    add_evaluation_arguments(parser, rules=GRID, limit=CALIBRATION_SPLIT)
    parser.set_defaults(handler=run_calibrate)
    return parser


def run_calibrate(args: argparse.Namespace, *, problems: dict | None = None) -> int:
    """The ``calibrate`` handler. ``problems`` (task name -> list of problems) replaces the
    datasets, for tests."""
    from flyspec.calibration import calibration_path, save_calibration
    from flyspec.evaluation.calibrate import run_calibration
    from flyspec.models import resolve_pair

    if not 0 < args.min_recovery <= 100:
        raise FlyspecError(f"--min-recovery is a percentage in (0, 100], got {args.min_recovery}")
    settings, base = evaluation_settings(args, ["target", "fly"], limit=CALIBRATION_SPLIT)
    path = calibration_path(*resolve_pair(args.target, args.draft))
    output = output_folder(args, "calibrate")
    calibration, _ = run_calibration(
        settings,
        base,
        min_recovery=args.min_recovery,
        load_engine=lambda with_draft: load_engine(args, with_draft=with_draft),
        output=output,
        command=command_line("calibrate"),
        problems=problems,
        vllm_spec=evaluation_vllm_spec(args, settings, base),
    )
    print((output / "calibration.md").read_text(encoding="utf-8"))
    if calibration is None:
        say(f"nothing saved; results in {output}/")
    elif args.no_save:
        say(f"not saved (--no-save); results in {output}/")
    else:
        save_calibration(calibration, path)
        say(
            f"saved as this pair's FLy rule: {path}; generate, bench and serve start from it "
            f"(--no-calibration ignores it); results in {output}/"
        )
    return 0
