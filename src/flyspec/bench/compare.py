"""``flyspec bench --compare OLD/bench.json``: how each method's speed moved between two runs.

For every method in both reports: the ratio of the new median tokens/s to the old one, each
side's range over its repeats, and a verdict (``faster``, ``slower`` or ``~``) that names a
change only where it is larger than the noise
(:class:`flyspec.support.repeated_measurements.Change`). The speedup over the baseline is
compared the same way, since it is the figure least moved by a machine that is faster or slower
as a whole. Where both reports hold the generated token ids, the
table also says on how many prompts a method produced the same tokens in both runs: a change to
the code that should not change what is generated must leave them all the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from flyspec.errors import FlyspecError
from flyspec.support.repeated_measurements import (
    NOISE_FLOOR,
    UNSTABLE_SPREAD,
    Change,
    Spread,
    compare,
)

__all__ = ["compare_reports", "format_comparison", "read_bench", "same_tokens"]


def read_bench(path: str | Path) -> dict:
    """A bench.json written by ``flyspec bench`` (a folder holding one is accepted too)."""
    path = Path(path)
    if path.is_dir():
        path = path / "bench.json"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FlyspecError(f"--compare: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FlyspecError(f"--compare: {path} is not a readable JSON file: {error}") from None
    if not isinstance(report, dict) or not isinstance(report.get("methods"), list):
        raise FlyspecError(f"--compare: {path} is not a bench.json (no 'methods' list)")
    return report


def recorded_spread(summary: Mapping, figure: str) -> Spread:
    """A method's ``figure`` (``tokens_per_second`` or ``speedup``) over its repeats, as its
    summary recorded it (a report from before repeats holds one value)."""
    recorded = summary.get(f"{figure}_spread")
    if recorded:
        return Spread.from_dict(recorded)
    value = summary.get(figure)
    return Spread.of([] if value is None else [value])


def compare_reports(old: Mapping, new: Mapping) -> list[tuple[str, Change, Change]]:
    """``(method, tokens/s change, speedup change)`` for each method in both reports."""
    old_summaries = {s["method"]: s for s in old["methods"]}
    rows = []
    for summary in new["methods"]:
        before = old_summaries.get(summary["method"])
        if before is None:
            continue
        changes = [
            compare(recorded_spread(before, figure), recorded_spread(summary, figure))
            for figure in ("tokens_per_second", "speedup")
        ]
        rows.append((summary["method"], *changes))
    return rows


def same_tokens(old: Mapping, new: Mapping, method: str) -> tuple[int, int] | None:
    """``(identical, compared)``: of the (prompt, repeat) samples of ``method`` in both
    reports, how many have the same token ids; None when either report holds none."""
    return _same_samples(old, new, method, lambda record: record.get("token_ids"))


STATISTICS = (
    "rounds",
    "drafted",
    "accepted",
    "loosely_accepted",
    "rejected",
    "emitted",
    "committed",
    "tau",
    "deferrals_confirmed",
    "deferrals_rolled_back",
)
"""The statistics of a sample :func:`same_statistics` compares (speeds and times aside)."""


def same_statistics(old: Mapping, new: Mapping, method: str) -> tuple[int, int] | None:
    """``(identical, compared)``: of the (prompt, repeat) samples of ``method`` with
    statistics in both reports, how many have the same :data:`STATISTICS`; None when either
    report holds none (a peer's samples, a report from before statistics were kept)."""

    def statistics(record: Mapping) -> dict | None:
        stats = record.get("stats")
        return {name: stats.get(name) for name in STATISTICS} if stats else None

    return _same_samples(old, new, method, statistics)


def _same_samples(
    old: Mapping, new: Mapping, method: str, value: Callable[[Mapping], object]
) -> tuple[int, int] | None:
    """``(identical, compared)``: of the (prompt, repeat) samples of ``method`` for which
    ``value`` is not None in both reports, how many have the same value there."""

    def values(report: Mapping) -> dict:
        records = (report.get("samples") or {}).get(method) or []
        return {
            (record.get("prompt_id"), record.get("repeat", 0)): found
            for record in records
            if (found := value(record)) is not None
        }

    before, after = values(old), values(new)
    shared = [key for key in after if key in before]
    if not shared:
        return None
    return sum(before[key] == after[key] for key in shared), len(shared)


def format_comparison(old: Mapping, new: Mapping, *, old_name: str = "old") -> str:
    """A Markdown table of :func:`compare_reports`, with the machines of both runs."""
    from flyspec.bench.report import machine_line

    rows = compare_reports(old, new)
    lines = [
        f"Compared with {old_name}:",
        f"- old: {machine_line(old.get('environment', {}))}, "
        f"{old.get('environment', {}).get('date')}",
        f"- new: {machine_line(new.get('environment', {}))}, "
        f"{new.get('environment', {}).get('date')}",
        "",
        "| method | tok/s old | tok/s new | new/old | change | speedup old | speedup new "
        "| change | same tokens | same statistics |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    baselines = [report.get("config", {}).get("baseline", "target") for report in (old, new)]
    same_baseline = baselines[0] == baselines[1]
    for method, speed, speedup in rows:
        speedup_verdict = speedup.verdict if same_baseline else "n/a"
        tokens = same_tokens(old, new, method)
        counts = same_statistics(old, new, method)
        lines.append(
            f"| {method} | {speed.old.describe()} | {speed.new.describe()} | "
            f"{speed.ratio:.3f} | {speed.verdict} | {speedup.old.describe(unit='x')} | "
            f"{speedup.new.describe(unit='x')} | {speedup_verdict} | "
            f"{'n/a' if tokens is None else f'{tokens[0]}/{tokens[1]}'} | "
            f"{'n/a' if counts is None else f'{counts[0]}/{counts[1]}'} |"
        )
    if not rows:
        lines.append("| (no method in both runs) | | | | | | | | | |")
    if not same_baseline:
        lines += [
            "",
            f"The speedups are over different baselines ({baselines[0]} in the old run, "
            f"{baselines[1]} in the new one): they are not compared.",
        ]
    lines += [
        "",
        "change: faster/slower where the runs' ranges over their repeats do not overlap and "
        f"the medians differ by more than {NOISE_FLOOR:.0%} (a run of one repeat counts as "
        f"{UNSTABLE_SPREAD:.0%} wide); ~ otherwise, within the noise. same tokens: the "
        "prompts (and repeats) on which the method generated the same token ids in both runs; "
        "same statistics: those on which its rounds, drafted, accepted, loosely accepted, "
        "rejected, emitted and committed tokens, tau and deferrals were the same.",
    ]
    return "\n".join(lines)
