"""Summaries of an evaluation: scores with Wilson intervals, recovery with a paired bootstrap
interval, speedup and tau, the problems whose outcome changed; written as JSON, Markdown and a
recovery-vs-speedup plot.

Conventions (the same as the benchmark's):

* speedup = mean over samples of tokens/s of the method / the same mean for the target alone,
  on the same problems; tokens/s of one sample = emitted tokens / seconds in the decoder
  (prefill included); ``time_speedup`` = mean seconds per problem of the target / the
  method's (answers that get longer or shorter count);
* tau = tokens emitted / rounds, pooled over the samples (1 for the target alone);
* recovery = method score / target score, in percent; its 95% interval is a paired percentile
  bootstrap over problems (the same resampled problems for both), undefined when the target
  scores 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from flyspec.decoding.stats import mean_speedup
from flyspec.evaluation import loosening
from flyspec.evaluation.runner import EvalMethod, Sample

Z_95 = 1.959963984540054
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def wilson_interval(successes: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (0..1); (0, 1) when total is 0."""
    if total <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= total:
        raise ValueError(f"successes must be in 0..{total}, got {successes}")
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == total else min(1.0, centre + half)
    return low, high


def paired_bootstrap_recovery(
    target_correct: Sequence[bool],
    method_correct: Sequence[bool],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float] | None:
    """95% percentile interval of 100 * method score / target score, resampling problems
    with replacement (paired). None when the target never scores or there are no problems."""
    import numpy as np

    target = np.asarray(target_correct, dtype=float)
    method = np.asarray(method_correct, dtype=float)
    if target.size == 0 or target.sum() == 0:
        return None
    rng = np.random.default_rng(seed)
    index = rng.integers(0, target.size, size=(resamples, target.size))
    target_scores = target[index].mean(axis=1)
    method_scores = method[index].mean(axis=1)
    valid = target_scores > 0
    ratios = 100.0 * method_scores[valid] / target_scores[valid]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def summarize(
    samples: Sequence[Sample], methods: Sequence[EvalMethod], task_names: Sequence[str]
) -> dict:
    """Per task, per method: score, interval, recovery, speedup, tau, changed outcomes."""
    tasks: dict[str, dict] = {}
    for task in task_names:
        by_method = {
            m.name: {s.problem_id: s for s in samples if s.task == task and s.method == m.name}
            for m in methods
        }
        target = by_method.get("target")
        summaries = {}
        for method in methods:
            rows = by_method[method.name]
            summaries[method.name] = _method_summary(method, rows, target)
        problem_ids = list(dict.fromkeys(s.problem_id for s in samples if s.task == task))
        tasks[task] = {"problems": len(problem_ids), "methods": summaries}
    return tasks


def _method_summary(method: EvalMethod, rows: dict[str, Sample], target: dict[str, Sample] | None):
    n = len(rows)
    correct = sum(s.outcome.correct for s in rows.values())
    low, high = wilson_interval(correct, n)
    emitted = sum(int(s.stats.get("emitted", 0)) for s in rows.values())
    # tau as RequestStats defines it (an ending EOS counts); entries cached before the
    # "committed" figure existed fall back to the emitted tokens.
    committed = sum(int(s.stats.get("committed", s.stats.get("emitted", 0))) for s in rows.values())
    rounds = sum(int(s.stats.get("rounds", 0)) for s in rows.values())
    mean_tps = _mean([s.tokens_per_second for s in rows.values()])
    summary: dict = {
        **method.as_dict(),
        "n": n,
        "correct": correct,
        "score": correct / n if n else None,
        "score_ci95": [low, high],
        "mean_tokens": emitted / n if n else None,
        "mean_tokens_per_second": mean_tps,
        "mean_seconds": _mean([float(s.stats.get("seconds", 0.0)) for s in rows.values()]),
        "time_speedup": None,
        "tau": committed / rounds if rounds else None,
        "accepted": sum(int(s.stats.get("accepted", 0)) for s in rows.values()),
        "loosely_accepted": sum(int(s.stats.get("loosely_accepted", 0)) for s in rows.values()),
        "cached": sum(s.cached for s in rows.values()),
        "recovery_percent": None,
        "recovery_ci95": None,
        "speedup": None,
        "identical_to_target": None,
        "changed": [],
    }
    if not target or not n:
        return summary
    shared = [pid for pid in rows if pid in target]
    target_correct = [target[pid].outcome.correct for pid in shared]
    method_correct = [rows[pid].outcome.correct for pid in shared]
    target_score = sum(target_correct) / len(shared) if shared else 0.0
    if target_score > 0:
        summary["recovery_percent"] = 100.0 * (sum(method_correct) / len(shared)) / target_score
        interval = paired_bootstrap_recovery(target_correct, method_correct)
        summary["recovery_ci95"] = list(interval) if interval else None
    speedup = mean_speedup(
        [rows[pid].tokens_per_second for pid in shared],
        [target[pid].tokens_per_second for pid in shared],
    )
    summary["speedup"] = None if math.isnan(speedup) else speedup
    target_seconds = _mean([float(target[pid].stats.get("seconds", 0.0)) for pid in shared])
    method_seconds = _mean([float(rows[pid].stats.get("seconds", 0.0)) for pid in shared])
    if target_seconds and method_seconds:
        summary["time_speedup"] = target_seconds / method_seconds
    summary["identical_to_target"] = sum(rows[pid].text == target[pid].text for pid in shared)
    summary["changed"] = [
        {
            "id": pid,
            "target": target[pid].outcome.label,
            "method": rows[pid].outcome.label,
            "target_correct": target[pid].outcome.correct,
            "method_correct": rows[pid].outcome.correct,
        }
        for pid in shared
        if target[pid].outcome.correct != rows[pid].outcome.correct
    ]
    return summary


def _seconds(summary: dict) -> str:
    seconds, ratio = summary["mean_seconds"], summary["time_speedup"]
    if seconds is None:
        return "n/a"
    return f"{seconds:.1f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ------------------------------------------------------------------------------------ output


def write_json(path: Path, payload: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    temporary.replace(path)


def _pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def _interval(pair: Sequence[float] | None, scale: float = 1.0, unit: str = "%") -> str:
    if not pair:
        return "n/a"
    return f"[{scale * pair[0]:.1f}, {scale * pair[1]:.1f}]{unit}"


def render_markdown(payload: dict) -> str:
    lines = [f"# flyspec eval — {payload['created']}", ""]
    models = payload["models"]
    cache = payload["cache"]
    lines += [
        f"- target: `{models['target'].get('path', models['target'].get('name'))}`",
        f"- draft: `{(models['draft'] or {}).get('path', 'none')}`",
        f"- decoding: {payload['settings']['decoding_summary']}",
        f"- prompts: {payload['settings']['prompt_style']}; sandbox: "
        f"{payload['sandbox']['backend'] if payload.get('sandbox') else 'not used'}",
        f"- cache: {cache['hits']} of {cache['hits'] + cache['misses']}"
        " generations came from the cache; their timings (speedup, tok/s) are those of the run "
        "that produced them.",
        "",
    ]
    engines = payload.get("vllm_engines")
    if engines is not None:
        kernels = models.get("kernels") or {}
        lines += [
            f"Generated by vLLM {kernels.get('vllm', '')} ({kernels.get('fly', '')} FLy), one "
            "engine per method, every generation of a method in flight at once: a sample's "
            "tok/s is its tokens over its batch's wall time, and tau comes from vLLM's metrics "
            "over the whole batch.",
            "",
            "| method | generations | wall s | tok/s (all in flight) | engine start s | tau |",
            "|---|---:|---:|---:|---:|---:|",
            *(
                f"| {name} | {e['generations']} | {e['wall_seconds']} | "
                f"{e['tokens_per_second']} | {e['engine_start_seconds']} | "
                f"{e.get('tau') or '–'} |"
                for name, e in engines.items()
            ),
            "",
        ]
    for task, result in payload["tasks"].items():
        lines += [f"## {task} ({result['problems']} problems)", ""]
        lines += [
            "| method | score | 95% CI (Wilson) | recovery | recovery 95% CI (bootstrap) "
            "| speedup | tau | tok/s | mean tokens | s/problem (time speedup) "
            "| same text as target | outcome changed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for summary in result["methods"].values():
            recovery = summary["recovery_percent"]
            speedup = summary["speedup"]
            tau = summary["tau"]
            tps = summary["mean_tokens_per_second"]
            mean_tokens = summary["mean_tokens"]
            same = summary["identical_to_target"]
            lines.append(
                "| "
                + " | ".join(
                    [
                        summary["label"],
                        f"{summary['correct']}/{summary['n']} ({_pct(summary['score'])})",
                        _interval(summary["score_ci95"], 100.0),
                        "n/a" if recovery is None else f"{recovery:.1f}%",
                        _interval(summary["recovery_ci95"]),
                        "n/a" if speedup is None else f"{speedup:.2f}x",
                        "n/a" if tau is None else f"{tau:.2f}",
                        "n/a" if tps is None else f"{tps:.2f}",
                        "n/a" if mean_tokens is None else f"{mean_tokens:.0f}",
                        _seconds(summary),
                        "n/a" if same is None else f"{same}/{summary['n']}",
                        str(len(summary["changed"])) if summary["mode"] != "target" else "-",
                    ]
                )
                + " |"
            )
        lines.append("")
        for summary in result["methods"].values():
            if not summary["changed"]:
                continue
            lines += [f"Outcomes changed by {summary['label']} (vs target):", ""]
            lines += ["| problem | target | " + summary["label"] + " |", "|---|---|---|"]
            lines += [f"| {c['id']} | {c['target']} | {c['method']} |" for c in summary["changed"]]
            lines.append("")
    if payload.get("plot"):
        lines += [f"![recovery vs speedup]({payload['plot']})", ""]
    lines += loosening.render_markdown(payload.get("loosening") or {})
    if payload.get("loosening_plot"):
        lines += [f"![loose tokens by outcome]({payload['loosening_plot']})", ""]
    lines += [
        "Speedup: mean per-sample tokens/s of the method over that of the target alone on the "
        "same problems. s/problem: mean decoder seconds per problem (prefill included); its "
        "ratio to the target's is the time-to-answer speedup, which also counts a method's "
        "longer or shorter answers. tau: emitted tokens per round, pooled. Recovery: score / "
        "target score; its interval is a paired percentile bootstrap over problems "
        f"({BOOTSTRAP_RESAMPLES} resamples).",
        "",
    ]
    return "\n".join(lines)


def plot_tradeoff(path: Path, payload: dict) -> bool:
    """Recovery (y) against speedup (x), one panel per task; False when nothing to plot."""
    panels = [
        (task, result)
        for task, result in payload["tasks"].items()
        if any(s["recovery_percent"] is not None for s in result["methods"].values())
    ]
    if not panels:
        return False
    from flyspec.support.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return False

    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    for axis, (task, result) in zip(axes[0], panels, strict=True):
        for summary in result["methods"].values():
            speedup, recovery = summary["speedup"], summary["recovery_percent"]
            if speedup is None or recovery is None:
                continue
            style = {
                "target": dict(marker="*", color="black", s=160),
                "spd": dict(marker="s", color="tab:blue", s=70),
            }.get(summary["mode"], dict(marker="o", color="tab:orange", s=60))
            axis.scatter([speedup], [recovery], zorder=3, **style)
            interval = summary["recovery_ci95"]
            if interval and summary["mode"] != "target":
                axis.errorbar(
                    [speedup],
                    [recovery],
                    yerr=[[recovery - interval[0]], [interval[1] - recovery]],
                    fmt="none",
                    ecolor=style["color"],
                    alpha=0.35,
                    capsize=3,
                )
        for (speedup, recovery, mode), labels in _label_groups(result["methods"].values()):
            axis.annotate(
                "\n".join(labels),
                (speedup, recovery),
                textcoords="offset points",
                xytext=(6, -12) if mode == "spd" else (6, 5),
                fontsize=8,
            )
        axis.axhline(100, color="grey", linewidth=0.8, linestyle="--")
        axis.axvline(1, color="grey", linewidth=0.8, linestyle="--")
        axis.set_title(f"{task} ({result['problems']} problems; orange: FLy θ, W)")
        axis.set_xlabel("speedup over the target alone (x)")
        axis.set_ylabel("accuracy recovery (% of target score)")
        axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _label_groups(summaries) -> list[tuple[tuple[float, float, str], list[str]]]:
    """Point labels, one per group of points that nearly coincide (within 0.03x speedup and 1.5
    points of recovery), so that the labels of settings with the same outcome stay readable.
    FLy's labels drop their "FLy " prefix: every orange point is a FLy setting."""
    groups: list[tuple[tuple[float, float, str], list[str]]] = []
    for summary in summaries:
        speedup, recovery = summary["speedup"], summary["recovery_percent"]
        if speedup is None or recovery is None:
            continue
        label = summary["label"].removeprefix("FLy ")
        for (x, y, _), labels in groups:
            if abs(x - speedup) <= 0.03 and abs(y - recovery) <= 1.5:
                labels.append(label)
                break
        else:
            groups.append(((speedup, recovery, summary["mode"]), [label]))
    return groups
