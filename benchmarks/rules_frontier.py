"""Recovery against tau of every FLy setting in some ``flyspec eval`` runs, the paper's rule
and the rules beyond it marked apart: the trade-off frontier of both families.

tau (tokens per round) stands for speed here because it does not depend on what else ran on
the machine; ``flyspec bench`` gives the speedups. Runs on the same problems are read
together (their targets must agree); one panel per problem set::

    .venv/bin/python benchmarks/rules_frontier.py results/tune-*/eval.json --output tune.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flyspec.config import FlyConfig


def settings_of(paths: list[Path], task: str) -> dict[str, dict]:
    """label -> the method summary of every FLy setting for ``task`` in these runs."""
    found: dict[str, dict] = {}
    for path in paths:
        payload = json.loads(path.read_text(encoding="utf-8"))
        result = payload["tasks"].get(task)
        if result is None:
            continue
        for summary in result["methods"].values():
            if summary["mode"] == "fly" and summary["recovery_percent"] is not None:
                found[summary["label"]] = summary
    return found


def beyond_paper(summary: dict) -> bool:
    """Whether a method summary's FLy setting uses a rule beyond the paper (summaries of runs
    made before those rules existed lack their fields: off)."""
    rules = {
        name: summary[name]
        for name in ("min_ratio", "max_rank", "max_draft_confidence", "defer")
        if summary.get(name) is not None
    }
    return FlyConfig(**rules).beyond_paper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="eval.json files")
    parser.add_argument("--task", default="humaneval", help="task to plot (humaneval)")
    parser.add_argument("--output", type=Path, required=True, help="PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.runs if not path.is_file()]
    if missing:
        parser.error(f"not a file: {', '.join(missing)}")
    settings = settings_of(args.runs, args.task)
    if not settings:
        print(f"no FLy setting with a recovery for {args.task} in these runs", file=sys.stderr)
        return 1

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 5))
    for label, summary in sorted(settings.items()):
        beyond = beyond_paper(summary)
        axis.scatter(
            [summary["tau"]],
            [summary["recovery_percent"]],
            marker="o" if beyond else "s",
            color="tab:orange" if beyond else "tab:blue",
            s=50,
            zorder=3,
        )
        axis.annotate(
            label.removeprefix("FLy "),
            (summary["tau"], summary["recovery_percent"]),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=7,
        )
        print(f"{label}: recovery {summary['recovery_percent']:.1f}%, tau {summary['tau']:.2f}")
    axis.scatter([], [], marker="s", color="tab:blue", label="the paper's rule")
    axis.scatter([], [], marker="o", color="tab:orange", label="with rules beyond the paper")
    axis.axhline(100, color="grey", linewidth=0.8, linestyle="--")
    axis.set_xlabel("tau (tokens per round)")
    axis.set_ylabel("accuracy recovery (% of the target's score)")
    axis.set_title(args.title or f"{args.task}: recovery against tau")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8, loc="lower left")
    figure.tight_layout()
    figure.savefig(args.output, dpi=120)
    plt.close(figure)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
