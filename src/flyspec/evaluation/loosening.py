"""What loosening did: every loosely kept token of FLy's generations joined with whether its
problem's outcome changed against the target, so that the features that separate harmful from
harmless loosening can be read off (the evidence behind the rules beyond the paper).

A token's *outcome* is its problem's: ``lost`` (the target solved it, the method did not),
``gained`` (the other way round) or ``unchanged``. A problem's tokens share its outcome, so a
harmless token in a lost problem counts as lost: the tables compare groups, not single tokens.
The *floor table* asks, for plausibility floors and draft-confidence caps the method did not
use, which share of the loose tokens of each group the rule would have refused, and in how
many lost problems it would have refused every loose token. Refusing a token changes what
follows it, so this is a guide for choosing candidates, not a measurement of them: only a run
with the rule on is.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from flyspec.evaluation.runner import EvalMethod, Sample

FEATURES = ("entropy", "draft_prob", "ratio", "rank", "position", "draft_confidence")
OUTCOMES = ("lost", "unchanged", "gained")
RATIO_FLOORS = (0.05, 0.1, 0.2, 0.3, 0.5)
RANK_FLOORS = (2, 3, 5)
DRAFT_CONFIDENCE_CAPS = (0.3, 0.5, 0.7, 0.9)


def _outcome(sample: Sample, target: Sample | None) -> str | None:
    if target is None:
        return None
    if target.outcome.correct and not sample.outcome.correct:
        return "lost"
    if sample.outcome.correct and not target.outcome.correct:
        return "gained"
    return "unchanged"


def analyse(
    samples: Sequence[Sample], methods: Sequence[EvalMethod], task_names: Sequence[str]
) -> dict:
    """Per task and FLy method: the loose-token records, feature summaries per outcome, and
    the floor table. Methods without loose tokens are left out."""
    result: dict[str, dict] = {}
    for task in task_names:
        targets = {s.problem_id: s for s in samples if s.task == task and s.method == "target"}
        per_method = {}
        for method in methods:
            if method.mode != "fly":
                continue
            records = []
            for sample in samples:
                if sample.task != task or sample.method != method.name:
                    continue
                outcome = _outcome(sample, targets.get(sample.problem_id))
                for token in sample.loose_tokens:
                    records.append({"problem_id": sample.problem_id, "outcome": outcome, **token})
            if records:
                per_method[method.name] = {
                    "label": method.label,
                    "tokens": records,
                    "features": _feature_summaries(records),
                    "floors": _floor_table(records),
                }
        if per_method:
            result[task] = per_method
    return result


def _feature_summaries(records: Sequence[dict]) -> dict:
    summaries = {}
    for outcome in OUTCOMES:
        group = [r for r in records if r["outcome"] == outcome]
        summaries[outcome] = {
            "tokens": len(group),
            "problems": len({r["problem_id"] for r in group}),
        }
        for feature in FEATURES:
            values = sorted(float(r[feature]) for r in group if r.get(feature) is not None)
            summaries[outcome][feature] = _quartiles(values)
    return summaries


def _quartiles(values: Sequence[float]) -> list[float] | None:
    """[first quartile, median, third quartile], or None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return [values[0]] * 3
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return [low, median, high]


def _refusals() -> list[tuple[str, Callable[[dict], bool | None]]]:
    """(name, whether the rule refuses a record) for each candidate rule of the floor table;
    None where a record lacks the feature (made before it was recorded)."""
    rules: list[tuple[str, Callable[[dict], bool | None]]] = []
    for value in RATIO_FLOORS:
        rules.append((f"ratio >= {value:g}", lambda r, v=value: r["ratio"] < v))
    for value in RANK_FLOORS:
        rules.append((f"rank <= {value}", lambda r, v=value: r["rank"] > v))
    for value in DRAFT_CONFIDENCE_CAPS:
        rules.append(
            (
                f"draft confidence <= {value:g}",
                lambda r, v=value: (
                    None if r.get("draft_confidence") is None else r["draft_confidence"] > v
                ),
            )
        )
    return rules


def _floor_table(records: Sequence[dict]) -> list[dict]:
    table = []
    for name, refuses in _refusals():
        refused = [refuses(r) for r in records]
        if any(hit is None for hit in refused):
            continue
        row = {"floor": name}
        for outcome in OUTCOMES:
            group = [
                hit for hit, r in zip(refused, records, strict=True) if r["outcome"] == outcome
            ]
            row[f"refused_{outcome}"] = sum(group) / len(group) if group else None
        lost_problems: dict[str, bool] = {}
        for hit, record in zip(refused, records, strict=True):
            if record["outcome"] == "lost":
                lost_problems[record["problem_id"]] = (
                    lost_problems.get(record["problem_id"], True) and hit
                )
        row["lost_problems_fully_refused"] = sum(lost_problems.values())
        row["lost_problems"] = len(lost_problems)
        table.append(row)
    return table


def render_markdown(analysis: dict) -> list[str]:
    """The loosening section of eval.md."""
    if not analysis:
        return []
    lines = ["## What loosening did", ""]
    for task, per_method in analysis.items():
        for summary in per_method.values():
            features = summary["features"]
            lines += [
                f"### {task}, {summary['label']}",
                "",
                "Loose tokens by the outcome of their problem against the target "
                "(quartiles: first, median, third):",
                "",
                "| outcome | tokens (problems) | " + " | ".join(FEATURES) + " |",
                "|---|---|" + "---|" * len(FEATURES),
            ]
            for outcome in OUTCOMES:
                group = features[outcome]
                cells = [_quartile_cell(group[feature]) for feature in FEATURES]
                lines.append(
                    f"| {outcome} | {group['tokens']} ({group['problems']}) | "
                    + " | ".join(cells)
                    + " |"
                )
            lines += [
                "",
                "Share of loose tokens a plausibility floor or a draft-confidence cap would "
                "have refused, and lost problems in which it would have refused every loose "
                "token:",
                "",
                "| rule | lost | unchanged | gained | lost problems fully refused |",
                "|---|---|---|---|---|",
            ]
            for row in summary["floors"]:
                shares = [_share(row[f"refused_{outcome}"]) for outcome in OUTCOMES]
                lines.append(
                    f"| {row['floor']} | "
                    + " | ".join(shares)
                    + f" | {row['lost_problems_fully_refused']}/{row['lost_problems']} |"
                )
            lines.append("")
    return lines


def _quartile_cell(values: list[float] | None) -> str:
    if values is None:
        return "–"
    return " / ".join(f"{v:.3g}" for v in values)


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def plot(path: Path, analysis: dict) -> bool:
    """Ratio to the target's top token (log x) against the gate's entropy (y) of every loose
    token, coloured by its problem's outcome; one panel per task and method. False when there
    is nothing to plot."""
    panels = [
        (task, summary) for task, per_method in analysis.items() for summary in per_method.values()
    ]
    if not panels:
        return False
    from flyspec.support.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return False

    colours = {"lost": "tab:red", "unchanged": "tab:grey", "gained": "tab:green", None: "black"}
    columns = min(3, len(panels))
    rows = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
    for axis, (task, summary) in zip(axes.flat, panels, strict=False):
        for outcome, colour in colours.items():
            group = [r for r in summary["tokens"] if r["outcome"] == outcome]
            if group:
                axis.scatter(
                    [r["ratio"] for r in group],
                    [r["entropy"] for r in group],
                    s=18,
                    alpha=0.7,
                    color=colour,
                    label=f"{outcome or 'no target'} ({len(group)})",
                )
        axis.set_xscale("log")
        axis.set_xlabel("target p(draft token) / p(top token)")
        axis.set_ylabel("target entropy at the token (gate)")
        axis.set_title(f"{task}: {summary['label']}", fontsize=9)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
