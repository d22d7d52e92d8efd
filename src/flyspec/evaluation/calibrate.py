"""``flyspec calibrate``'s work: evaluate a grid of FLy rules against the target alone on a
calibration split and choose the loosest that keeps enough of its score
(:mod:`flyspec.calibration`)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flyspec.calibration import Calibration, Candidate, choose, fly_settings
from flyspec.config import DecodeConfig, FlyConfig
from flyspec.errors import FlyspecError
from flyspec.evaluation.run import EvalSettings, run_evaluation
from flyspec.evaluation.runner import EvalMethod


def candidates_from(
    tasks: Mapping, methods: Sequence[EvalMethod], engines: Mapping[str, Mapping] | None = None
) -> list[Candidate]:
    """One candidate per FLy method of an evaluation's per-task summaries (``eval.json``'s
    ``tasks``): its recovery on each task and its tokens per round, averaged over the tasks
    (or, from vLLM, ``engines``: the tau of each method's engine over all its generations)."""
    candidates = []
    for method in methods:
        if method.mode != "fly":
            continue
        summaries = [tasks[task]["methods"][method.name] for task in tasks]
        taus = [s["tau"] for s in summaries if s["tau"] is not None]
        if engines and engines.get(method.name, {}).get("tau") is not None:
            taus = [engines[method.name]["tau"]]
        candidates.append(
            Candidate(
                fly=method.fly,
                recovery={
                    task: s["recovery_percent"] for task, s in zip(tasks, summaries, strict=True)
                },
                tau=statistics.fmean(taus) if taus else None,
            )
        )
    return candidates


def run_calibration(
    settings: EvalSettings,
    base: DecodeConfig,
    *,
    min_recovery: float,
    load_engine: Callable[[bool], object],
    output: Path,
    command: str,
    problems: Mapping[str, Sequence] | None = None,
    vllm_spec=None,
) -> tuple[Calibration | None, list[Candidate]]:
    """Evaluate ``settings.methods`` (the target and FLy rules) into ``output``, write
    ``calibration.md`` there, and return the chosen calibration (None when no rule keeps
    ``min_recovery`` percent on every task) with every candidate."""
    modes = {method.mode for method in settings.methods}
    if "target" not in modes or "fly" not in modes:
        raise FlyspecError("a calibration needs the target alone and at least one FLy rule")
    payload = run_evaluation(
        settings,
        base,
        load_engine=load_engine,
        output=output,
        command=command,
        problems=problems,
        vllm_spec=vllm_spec,
    )
    candidates = candidates_from(payload["tasks"], settings.methods, payload.get("vllm_engines"))
    best = choose(candidates, min_recovery=min_recovery)
    calibration = None
    if best is not None:
        calibration = Calibration(
            fly=best.fly,
            min_recovery=min_recovery,
            recovery=dict(best.recovery),
            tau=best.tau,
            problems={
                task: list(info["range"]) for task, info in payload["settings"]["tasks"].items()
            },
            created=time.strftime("%Y-%m-%d %H:%M:%S %z"),
            command=command,
        )
    (output / "calibration.md").write_text(
        render_markdown(candidates, best, min_recovery=min_recovery), encoding="utf-8"
    )
    return calibration, candidates


def render_markdown(
    candidates: Sequence[Candidate], best: Candidate | None, *, min_recovery: float
) -> str:
    """The table of every rule tried, loosest (most tokens per round) first, and the choice."""
    tasks = list(dict.fromkeys(task for c in candidates for task in c.recovery))
    lines = [
        "# flyspec calibrate",
        "",
        f"Rules that keep at least {min_recovery:g}% of the target's score on every task, the "
        "one with the most tokens per round chosen.",
        "",
        "| rule | " + " | ".join(f"{task} recovery" for task in tasks) + " | tau | keeps |",
        "|---|" + "---:|" * len(tasks) + "---:|---|",
    ]
    ordered = sorted(candidates, key=lambda c: -(c.tau or 0.0))
    for candidate in ordered:
        cells = [
            "n/a" if candidate.recovery.get(t) is None else f"{candidate.recovery[t]:.1f}%"
            for t in tasks
        ]
        tau = "n/a" if candidate.tau is None else f"{candidate.tau:.2f}"
        mark = "yes" if candidate.keeps(min_recovery) else "no"
        if candidate is best:
            mark = "**chosen**"
        lines.append(f"| `{fly_settings(candidate.fly)}` | {' | '.join(cells)} | {tau} | {mark} |")
    lines.append("")
    if best is None:
        lines.append(
            f"No rule kept {min_recovery:g}% on every task: nothing is saved, and the pair's "
            "defaults stay the paper's."
        )
    else:
        lines.append(f"Chosen: `{fly_settings(best.fly)}`.")
        lines += ["", *deployment_lines(best.fly)]
    return "\n".join(lines) + "\n"


def deployment_lines(fly: FlyConfig) -> list[str]:
    """How to run ``fly`` in vLLM: the ``speculative_config`` keys of a vLLM with FLy built in
    (0.34 and later) and the ``additional_config`` of flyspec's plugin (vLLM 0.32), or why
    one of them cannot run it."""
    from flyspec.integrations.vllm.settings import additional_config, native_speculative_keys

    ways = (
        (
            "vLLM with FLy built in (0.34 and later), in speculative_config",
            lambda: native_speculative_keys(fly, vllm_version="0.34 and later"),
        ),
        ("flyspec's plugin on vLLM 0.32, as additional_config", lambda: additional_config(fly)),
    )
    lines = []
    for where, keys in ways:
        try:
            lines.append(f"- {where}: `{json.dumps(keys())}`")
        except FlyspecError as error:
            lines.append(f"- {where}: not available ({error})")
    return lines
