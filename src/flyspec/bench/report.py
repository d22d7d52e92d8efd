"""Benchmark figures, and their JSON and Markdown (the plots are in :mod:`flyspec.bench.plots`).

Conventions (Spec-Bench): the speedup of a method is the ratio of its *mean per-sample*
tokens/second to the target's; tau is the pooled number of tokens emitted per round (all
rounds of all samples); acceptance rates are pooled over all drafted tokens. The acceptance at
draft position i is the probability that position i is kept (exactly or loosely) given that it
was drafted.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from flyspec.bench.methods import PEER_BASELINES
from flyspec.bench.plots import has_per_position, write_plots
from flyspec.decoding.stats import RoundStats, kept_per_block, mean_speedup
from flyspec.support.repeated_measurements import UNSTABLE_SPREAD, Spread
from flyspec.support.resident_memory import gib


def per_position_acceptance(rounds: Iterable[RoundStats], k: int) -> list[float | None]:
    """For i = 0 .. k-1: kept-at-i / drafted-at-i over all rounds (None where nothing was
    drafted). A round that drafted d tokens and kept a of them (exactly or loosely, a deferred
    window the next round confirmed included) kept positions 0 .. a-1 and rejected a .. d-1."""
    drafted = [0] * k
    kept = [0] * k
    rounds = list(rounds)
    for round_stats, kept_here in zip(rounds, kept_per_block(rounds), strict=True):
        for position in range(min(round_stats.drafted, k)):
            drafted[position] += 1
            if position < kept_here:
                kept[position] += 1
    return [kept[i] / drafted[i] if drafted[i] else None for i in range(k)]


def tokens_per_round_histogram(rounds: Iterable[RoundStats], k: int) -> list[int]:
    """``counts[n]`` = rounds that emitted n tokens, n = 0 .. k+1 (0: EOS right away)."""
    counts = [0] * (k + 2)
    for round_stats in rounds:
        counts[min(round_stats.emitted, k + 1)] += 1
    return counts


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (None when equal)."""
    for index, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def summarise_method(
    name: str,
    samples: Sequence[dict],
    rounds: Sequence[RoundStats] | None,
    target_tokens_per_second: Sequence[float],
    *,
    k: int,
    settings: Mapping,
) -> dict:
    """Figures of one method from its per-sample records (see :func:`sample_record`) and, for
    flyspec's methods, all its rounds.

    ``target_tokens_per_second[i]`` is the baseline's speed on the prompt and repeat of
    ``samples[i]``. Speed and speedup are taken per repeat (the mean over the prompts, and
    its ratio to the baseline's in the same repeat) and reported as the median over the
    repeats with their range; prompts whose repeats disagree are listed.
    """
    if len(target_tokens_per_second) != len(samples):
        raise ValueError(
            f"{len(samples)} samples but {len(target_tokens_per_second)} baseline speeds"
        )
    repeats = sorted({s.get("repeat", 0) for s in samples})
    speeds, speedups = [], []
    for repeat in repeats:
        chosen = [i for i, s in enumerate(samples) if s.get("repeat", 0) == repeat]
        speed = [samples[i]["tokens_per_second"] for i in chosen]
        speeds.append(statistics.fmean(speed))
        speedups.append(mean_speedup(speed, [target_tokens_per_second[i] for i in chosen]))
    speed_spread, speedup_spread = Spread.of(speeds), Spread.of(speedups)
    new_tokens = sum(s["new_tokens"] for s in samples)
    seconds = sum(s["seconds"] for s in samples)
    summary: dict = {
        "method": name,
        "kind": "hf" if name.startswith("hf-") else "flyspec",
        "settings": dict(settings),
        "samples": len(samples),
        "repeats": len(repeats),
        "new_tokens": new_tokens,
        "seconds": _round(seconds),
        "tokens_per_second": _round(speed_spread.median),
        "tokens_per_second_spread": speed_spread.as_dict(),
        "tokens_per_second_pooled": _round(_ratio(new_tokens, seconds)),
        "speedup": _round(speedup_spread.median),
        "speedup_spread": speedup_spread.as_dict(),
        "unstable_prompts": unstable_prompts(samples),
        "identical_to_target": sum(1 for s in samples if s["identical_to_target"]),
        "peak_rss_bytes": max((s.get("peak_rss_bytes", 0) for s in samples), default=0),
        "touched_bytes": max((s.get("touched_bytes", 0) for s in samples), default=0),
        "state_bytes_longest_prompt": max(
            samples, key=lambda s: s.get("prompt_tokens", 0) + s["new_tokens"], default={}
        ).get("state_bytes", 0),
    }
    if name.startswith("llama-server"):
        summary["kind"] = "llama-server"
        summary.update(_server_drafts(samples))
    if rounds is None:
        return summary
    stats = [s["stats"] for s in samples]
    drafted = sum(st["drafted"] for st in stats)
    accepted = sum(st["accepted"] for st in stats)
    loose = sum(st["loosely_accepted"] for st in stats)
    num_rounds = len(rounds)
    summary.update(
        rounds=num_rounds,
        tau=_round(_ratio(sum(r.committed for r in rounds), num_rounds)),
        drafted=drafted,
        accepted=accepted,
        loosely_accepted=loose,
        acceptance_rate=_round(_ratio(accepted, drafted)),
        loose_acceptance_rate=_round(_ratio(loose, drafted)),
        draft_seconds=_round(sum(st["draft_seconds"] for st in stats)),
        verify_seconds=_round(sum(st["verify_seconds"] for st in stats)),
        prefill_seconds=_round(sum(st["prefill_seconds"] for st in stats)),
        per_position_acceptance=[_round(p) for p in per_position_acceptance(rounds, k)],
        tokens_per_round_histogram=tokens_per_round_histogram(rounds, k),
    )
    return summary


def _server_drafts(samples: Sequence[dict]) -> dict:
    """llama-server's drafted and accepted tokens over ``samples``, from its own timings
    (empty where it drafted nothing)."""
    timings = [s.get("server_timings") or {} for s in samples]
    drafted = sum(t.get("draft_n", 0) for t in timings)
    if not drafted:
        return {}
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    return {"drafted": drafted, "accepted": accepted, "acceptance_rate": _round(accepted / drafted)}


def unstable_prompts(samples: Sequence[dict]) -> list[dict]:
    """The prompts whose speed across repeats spreads by more than
    :data:`~flyspec.support.repeated_measurements.UNSTABLE_SPREAD` of its median, with that
    spread."""
    speeds: dict[str, list[float]] = {}
    for sample in samples:
        speeds.setdefault(sample["prompt_id"], []).append(sample["tokens_per_second"])
    flagged = []
    for prompt_id, values in speeds.items():
        spread = Spread.of(values)
        if spread.unstable:
            flagged.append({"prompt_id": prompt_id, "tokens_per_second": spread.as_dict()})
    return flagged


def decoding_settings(config) -> dict:
    """The settings of a :class:`~flyspec.config.DecodeConfig` a report records."""
    return {
        "max_new_tokens": config.max_new_tokens,
        "k": config.k,
        "window": config.fly.window,
        "theta": config.fly.theta,
        "entropy": config.fly.entropy,
        "temperature": config.sampling.temperature,
        "top_k": config.sampling.top_k,
        "top_p": config.sampling.top_p,
        "seed": config.sampling.seed,
    }


def sample_records(
    prompts, prompts_ids, runs, baseline_runs, *, decode, repeat: int = 0
) -> list[dict]:
    """:func:`sample_record` of each run (a :class:`~flyspec.bench.methods.SampleRun`),
    compared with the baseline's run of the same prompt, all in the given ``repeat``."""
    return [
        sample_record(
            prompts[index].id,
            len(prompts_ids[index]),
            run.token_ids,
            run.seconds,
            baseline_runs[index].token_ids,
            stats=run.stats.as_dict() if run.stats is not None else None,
            text=decode(run.token_ids),
            repeat=repeat,
            peak_rss_bytes=run.peak_rss_bytes,
            state_bytes=run.state_bytes,
            touched_bytes=run.touched_bytes,
            prefill_seconds=run.prefill_seconds,
            server_timings=run.server_timings,
        )
        for index, run in enumerate(runs)
    ]


def sample_record(
    prompt_id: str,
    prompt_tokens: int,
    token_ids: Sequence[int],
    seconds: float,
    target_token_ids: Sequence[int],
    *,
    stats: dict | None = None,
    text: str | None = None,
    repeat: int = 0,
    peak_rss_bytes: int = 0,
    state_bytes: int = 0,
    touched_bytes: int = 0,
    prefill_seconds: float | None = None,
    server_timings: dict | None = None,
) -> dict:
    """One run's record; ``decode_tokens_per_second`` is its speed once the prompt was read
    (all but its last token: ``prefill_seconds``), None where the method does not say;
    ``server_timings``: llama-server's own account of the request, where one served it."""
    divergence = first_divergence(token_ids, target_token_ids)
    decoding = None if prefill_seconds is None else seconds - prefill_seconds
    return {
        "peak_rss_bytes": peak_rss_bytes,
        "state_bytes": state_bytes,
        "touched_bytes": touched_bytes,
        "prompt_id": prompt_id,
        "repeat": repeat,
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(token_ids),
        "seconds": round(seconds, 4),
        "tokens_per_second": round(len(token_ids) / seconds, 4) if seconds > 0 else 0.0,
        "prefill_seconds": None if prefill_seconds is None else round(prefill_seconds, 4),
        "decode_tokens_per_second": (
            round(len(token_ids) / decoding, 4) if decoding is not None and decoding > 0 else None
        ),
        "identical_to_target": divergence is None,
        "first_divergence": divergence,
        "stats": stats,
        "server_timings": server_timings,
        "token_ids": list(token_ids),
        "text": text,
    }


def environment() -> dict:
    """Versions, threads, the machine's full identity and math settings, for the record."""
    import torch
    import transformers

    from flyspec.support.machine import machine_identity

    machine = machine_identity()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_model": machine["cpu_model"],
        "cpu_count": os.cpu_count(),
        "machine": machine,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "MKL_CBWR": os.environ.get("MKL_CBWR"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _with_range(value, spread: Mapping | None, unit: str) -> str:
    """``2.05x``, or ``2.05x (1.98-2.10)`` where the value is a median over repeats."""
    if value is None:
        return "–"
    text = f"{value:.2f}{unit}"
    if spread and spread.get("repeats", 1) > 1 and spread.get("low") is not None:
        text += f" ({spread['low']:.2f}-{spread['high']:.2f})"
    return text


def markdown_table(summaries: Sequence[Mapping], *, baseline: str = "target") -> str:
    """One row per method: speed, speedup, tau, acceptance, time split, identical outputs,
    and the throughput with several requests in flight where it was measured."""
    concurrent = any(s.get("concurrent_tokens_per_second") for s in summaries)
    header = (
        "| method | tok/s | speedup | tau | accepted | loosely | prefill s | drafting s "
        f"| verifying s | = {baseline} | own memory GiB | process peak GiB |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    peer_columns = []  # (key, header) of the speedups over llama.cpp's plain decoding
    for peer, suffix in PEER_BASELINES.items():
        over, decoding_over = f"speedup_over_{suffix}", f"decode_speedup_over_{suffix}"
        if peer != baseline and any(s.get(over) is not None for s in summaries):
            peer_columns.append((over, f"over {peer}"))
        if any(s.get(decoding_over) is not None for s in summaries):
            peer_columns.append((decoding_over, f"decoding over {peer}"))
    for _, title in peer_columns:
        header += f" {title} |"
        rule += "---:|"
    if concurrent:
        header += " tok/s in flight |"
        rule += "---:|"
    lines = [header, rule]
    for s in summaries:
        cells = [
            s["method"],
            _with_range(s["tokens_per_second"], s.get("tokens_per_second_spread"), ""),
            _with_range(s["speedup"], s.get("speedup_spread"), "x"),
            _cell(s.get("tau"), ".2f"),
            _cell(s.get("acceptance_rate"), ".1%"),
            _cell(s.get("loose_acceptance_rate"), ".1%"),
            _cell(s.get("prefill_seconds"), ".1f"),
            _cell(s.get("draft_seconds"), ".1f"),
            _cell(s.get("verify_seconds"), ".1f"),
            f"{s['identical_to_target']}/{s['samples']}"
            + ("" if s.get("identical_to", baseline) == baseline else f" ({s['identical_to']})"),
            _cell(gib(s["touched_bytes"]) if s.get("touched_bytes") else None, ".2f"),
            _cell(gib(s["peak_rss_bytes"]) if s.get("peak_rss_bytes") else None, ".2f"),
        ]
        cells += [_with_range(s.get(key), None, "x") for key, _ in peer_columns]
        if concurrent:
            cells.append(_cell(s.get("concurrent_tokens_per_second"), ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(report: Mapping) -> str:
    config = report["config"]
    env = report["environment"]
    baseline = config.get("baseline", "target")
    lines = [
        f"# flyspec bench: {config['dataset']}",
        "",
        f"{config['prompts']} prompts, max {config['max_new_tokens']} new tokens, "
        f"K={config['k']}, W={config['window']}, theta={config['theta']}, "
        f"T={config['temperature']}, chat={config['chat']}; target {config['target']}, "
        f"draft {config['draft']}; {env['torch_threads']} torch threads, "
        f"MKL_CBWR={env['MKL_CBWR']}, {env['date']}.",
        "",
        f"Machine: {machine_line(env)}.",
        "",
        markdown_table(report["methods"], baseline=baseline),
        "",
        f"Speedup: mean per-sample tokens/s over {baseline}'s. tau: tokens per round. "
        "accepted / loosely: exact and loose acceptances per drafted token. "
        f"= {baseline}: outputs identical to {baseline}'s, token for token"
        + ("" if baseline == "target" else " (flyspec's methods: to flyspec's target)")
        + ". transformers' methods (hf-*) report speed only. own memory: the resident memory "
        "a run of the method read or wrote (its models, caches and buffers; Linux's "
        "referenced pages, cleared before each run), its largest over the prompts. process "
        "peak: the most resident memory of flyspec's process and its children (a vLLM "
        "engine's) while the method ran, every method's models included.",
    ]
    failed = report.get("failed_methods") or []
    if failed:
        lines += ["", "Methods that failed (no figures; the others ran on):", ""]
        lines += [f"- {failure['method']}: {failure['reason']}" for failure in failed]
    repeats = config.get("repeats", 1)
    if repeats > 1:
        lines += [
            "",
            f"tok/s and speedup: medians over {repeats} repeats (each repeat runs every "
            "method once per prompt, in a rotated order), with their range; the speedup is "
            f"the median of the per-repeat ratios to {baseline}.",
        ]
    load = report.get("machine_load")
    if load:
        lines += ["", f"Machine load during the run: {_load_line(load)}."]
    unstable = unstable_line(report["methods"])
    if unstable:
        lines += ["", unstable + "."]
    per_position = [s for s in report["methods"] if has_per_position(s)]
    if per_position:
        k = len(per_position[0]["per_position_acceptance"])
        lines += [
            "",
            "Acceptance by draft position (kept / drafted):",
            "",
            "| method | " + " | ".join(str(i) for i in range(k)) + " |",
            "|---|" + "---:|" * k,
        ]
        for s in per_position:
            lines.append(
                f"| {s['method']} | "
                + " | ".join(_cell(p, ".2f") for p in s["per_position_acceptance"])
                + " |"
            )
    return "\n".join(lines) + "\n"


def unstable_line(summaries: Sequence[Mapping]) -> str | None:
    """The prompts whose repeats disagree, in one sentence (None when there are none)."""
    unstable = [(s["method"], p) for s in summaries for p in s.get("unstable_prompts", ())]
    if not unstable:
        return None
    return (
        f"Prompts whose repeats disagree by more than {UNSTABLE_SPREAD:.0%} of their median "
        "speed: "
        + ", ".join(
            f"{method} on {p['prompt_id']} ({p['tokens_per_second']['relative_spread']:.0%})"
            for method, p in unstable
        )
    )


def machine_line(env: Mapping) -> str:
    from flyspec.support.machine import describe_machine

    return describe_machine(env["machine"]) if env.get("machine") else str(env.get("cpu_model"))


def _load_line(load: Mapping) -> str:
    from flyspec.support.machine import CpuLoad

    return CpuLoad.from_dict(dict(load)).describe()


def write_report(report: dict, folder: Path) -> list[str]:
    """bench.json, bench.md and the plots into ``folder``; returns the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, folder)
    report["files"] = ["bench.json", "bench.md", *plots]
    (folder / "bench.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    (folder / "bench.md").write_text(markdown_report(report))
    return report["files"]
