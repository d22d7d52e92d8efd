"""``flyspec bench``'s measurements: speed of flyspec's methods and transformers' peers, side by
side (:func:`run_benchmark`), vLLM's methods (:mod:`flyspec.bench.vllm`) and the cost of a
multi-token forward (:mod:`flyspec.bench.forward_cost`).

Every method runs on the same models and prompts, interleaved per prompt (A B C A B C ...)
so that a noisy machine's drift hits all alike, after one untimed warm-up generation each.

Heavy imports (torch, transformers, matplotlib) happen inside the functions, so that
``flyspec --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flyspec.bench.methods import (
    LLAMA_SERVER_METHOD_NAMES,
    LLAMACPP_METHODS,
    LOSSLESS_METHODS,
    PEER_BASELINES,
    make_method,
    measured_run,
    method_base,
    parse_methods,
)
from flyspec.bench.prompts import BenchPrompt
from flyspec.errors import FlyspecError

if TYPE_CHECKING:
    from flyspec.config import DecodeConfig

__all__ = ["add_flyspec_methods", "console_notes", "lossless_warnings", "run_benchmark"]


def run_benchmark(
    engine,
    prompts: Sequence[BenchPrompt],
    method_names: Sequence[str],
    config,
    *,
    progress: bool = True,
    dataset: str = "prompts",
    warmup: bool = True,
    repeats: int = 1,
    llamacpp_engine=None,
    baseline: str = "target",
) -> dict:
    """Run every method on every prompt, interleaved per prompt, ``repeats`` times; return the
    report (config, environment, what else used the CPU, per-method figures and per-sample
    records, every repeat's). ``config`` (a DecodeConfig) carries K, the FLy rule, sampling
    and ``max_new_tokens``; each method sets its own mode.

    ``engine``: flyspec's engine for flyspec's and transformers' methods (None when only
    llama.cpp's run); ``llamacpp_engine``: the same pair on llama.cpp, for the ``llamacpp-*``
    methods, whose outputs are compared with ``llamacpp-target``'s where it runs. Speedups are
    over ``baseline``, and also over ``llamacpp-target`` where it runs."""
    from flyspec.bench.report import environment
    from flyspec.support.machine import combined_load

    method_names = parse_methods(",".join(method_names), baseline=baseline)
    _check_inputs(prompts, repeats)
    pair = engine or llamacpp_engine
    workload = _Workload.encode(pair.tokenizer, prompts, config)
    failures = MethodFailures(baseline)
    with contextlib.ExitStack() as running:
        methods = _load_methods(
            method_names, engine, workload, failures, llamacpp=llamacpp_engine, running=running
        )
        if warmup:
            _warm_up(methods, workload, failures, progress=progress)
        measured = _measure(methods, workload, failures, repeats=repeats, progress=progress)
    methods = [method for method in methods if method.name not in failures]
    samples, summaries = _summarise(methods, workload, measured.runs, baseline=baseline)
    _add_peer_speedups(summaries, samples)
    return {
        "config": _run_config(
            workload,
            method_names,
            measured.orders,
            pair=pair,
            llamacpp_engine=llamacpp_engine,
            dataset=dataset,
            baseline=baseline,
            warmup=warmup,
            repeats=repeats,
        ),
        "environment": environment(),
        "machine_load": combined_load(measured.loads).as_dict(),
        "machine_load_per_repeat": [one.as_dict() for one in measured.loads],
        "methods": summaries,
        "failed_methods": failures.as_list(),
        "prompts": [prompt.as_dict() for prompt in prompts],
        "samples": samples,
    }


@dataclass(frozen=True)
class _Workload:
    """The prompts every method runs on, as token ids, with the decoding settings and the
    tokenizer."""

    prompts: Sequence[BenchPrompt]
    prompt_ids: list[list[int]]
    prediction_ids: list[list[int] | None]
    config: DecodeConfig
    tokenizer: object

    @classmethod
    def encode(cls, tokenizer, prompts: Sequence[BenchPrompt], config: DecodeConfig) -> _Workload:
        from flyspec.bench.prompts import encode_prediction, encode_prompts

        prompt_ids = encode_prompts(tokenizer, prompts)
        prediction_ids = [encode_prediction(tokenizer, prompt) for prompt in prompts]
        return cls(prompts, prompt_ids, prediction_ids, config, tokenizer)

    def seed(self, index: int) -> int | None:
        """The sampling seed of the ``index``-th prompt (None: unseeded)."""
        seed = self.config.sampling.seed
        return None if seed is None else seed + index

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class _Measurements:
    """The timed runs, ``runs[name][repeat][prompt]``, and each repeat's machine load and
    order of methods."""

    runs: dict[str, list[list]]
    loads: list = field(default_factory=list)
    orders: list[list[str]] = field(default_factory=list)


def _check_inputs(prompts: Sequence[BenchPrompt], repeats: int) -> None:
    """FlyspecError where there is nothing to run."""
    if not prompts:
        raise FlyspecError("no prompts to benchmark")
    if repeats < 1:
        raise FlyspecError(f"repeats must be >= 1, got {repeats}")


def _load_methods(
    method_names: Sequence[str],
    engine,
    workload: _Workload,
    failures: MethodFailures,
    *,
    llamacpp,
    running: contextlib.ExitStack,
) -> list:
    """Each method that loads, its ``close`` (a child server's stop) left to ``running``;
    those that fail are recorded in ``failures``."""
    config = workload.config
    longest = max(len(ids) for ids in workload.prompt_ids) + config.max_new_tokens
    methods = []
    for name in method_names:
        with failures.catch(name, during="loading"):
            method = make_method(name, engine, config, llamacpp_engine=llamacpp, longest=longest)
            if hasattr(method, "close"):
                running.callback(method.close)
            methods.append(method)
    return methods


def _warm_up(
    methods: Sequence, workload: _Workload, failures: MethodFailures, *, progress: bool
) -> None:
    """One short, untimed generation per method, on the first prompt."""
    from tqdm import tqdm

    config = workload.config
    warmup_tokens = min(config.max_new_tokens, 2 * (config.k + 1))
    for method in tqdm(methods, desc="warm-up", file=sys.stderr, disable=not progress):
        with failures.catch(method.name, during="the warm-up"):
            method.run(
                workload.prompt_ids[0],
                max_new_tokens=warmup_tokens,
                seed=workload.seed(0),
                prediction_ids=workload.prediction_ids[0],
            )


def _measure(
    methods: Sequence,
    workload: _Workload,
    failures: MethodFailures,
    *,
    repeats: int,
    progress: bool,
) -> _Measurements:
    """The timed runs: each repeat runs every method once per prompt, the order rotated by one
    method per repeat so that no method always runs first after another."""
    from tqdm import tqdm

    from flyspec.support.machine import CpuMonitor

    measured = _Measurements({method.name: [[] for _ in range(repeats)] for method in methods})
    bar = tqdm(
        total=repeats * len(workload.prompts) * len(methods),
        desc="bench",
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        for repeat in range(repeats):
            order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
            measured.orders.append([method.name for method in order])
            with CpuMonitor(include_children=True) as monitor:  # llama-server
                _run_repeat(order, workload, failures, measured.runs, repeat, repeats, bar)
            measured.loads.append(monitor.load)
    return measured


def _run_repeat(
    order: Sequence,
    workload: _Workload,
    failures: MethodFailures,
    runs: dict[str, list[list]],
    repeat: int,
    repeats: int,
    bar,
) -> None:
    """One repeat: on each prompt in turn, the methods in ``order`` that have not failed."""
    for index, ids in enumerate(workload.prompt_ids):
        prompt_id = workload.prompts[index].id
        for method in order:
            bar.update()
            if method.name in failures:
                continue
            bar.set_postfix_str(f"{repeat + 1}/{repeats} {prompt_id} {method.name}", refresh=False)
            with failures.catch(method.name, during=f"prompt {prompt_id}"):
                runs[method.name][repeat].append(
                    measured_run(
                        method,
                        ids,
                        max_new_tokens=workload.config.max_new_tokens,
                        seed=workload.seed(index),
                        prediction_ids=workload.prediction_ids[index],
                    )
                )


def _summarise(
    methods: Sequence, workload: _Workload, runs: dict[str, list[list]], *, baseline: str
) -> tuple[dict[str, list[dict]], list[dict]]:
    """Each method's per-sample records (every repeat's) and its summary, the baseline's
    first."""
    from flyspec.bench.report import summarise_method

    samples: dict[str, list[dict]] = {}
    summaries = []
    measured_names = [method.name for method in methods]
    for method in methods:
        reference = reference_method(method.name, measured_names, baseline)
        samples[method.name] = _records(workload, runs[method.name], runs[reference])
        summary = summarise_method(
            method.name,
            samples[method.name],
            _rounds(runs[method.name]),
            _speeds(samples, baseline),  # the baseline runs first
            k=getattr(method, "config", workload.config).k,
            settings=method.settings,
        )
        summary["identical_to"] = reference
        summaries.append(summary)
    return samples, summaries


def _records(workload: _Workload, own: list[list], reference: list[list]) -> list[dict]:
    """A method's per-sample records, repeat after repeat, its outputs compared with those of
    the ``reference`` runs."""
    from flyspec.bench.report import sample_records

    return [
        record
        for repeat in range(len(own))
        for record in sample_records(
            workload.prompts,
            workload.prompt_ids,
            own[repeat],
            reference[repeat],
            decode=workload.decode,
            repeat=repeat,
        )
    ]


def _rounds(method_runs: list[list]) -> list | None:
    """Every round of a method's runs, None where some run has no statistics."""
    if not all(run.stats is not None for repeat in method_runs for run in repeat):
        return None
    return [r for repeat in method_runs for run in repeat for r in run.stats.rounds]


def _add_peer_speedups(summaries: list[dict], samples: dict) -> None:
    """Each summary's speedups over llama.cpp's plain decoding, by its server and its binding,
    where they ran (:data:`~flyspec.bench.methods.PEER_BASELINES`)."""
    for peer, suffix in PEER_BASELINES.items():
        if peer not in samples:
            continue
        for summary in summaries:
            summary[f"speedup_over_{suffix}"] = _speedup_over(
                summary, samples, _speeds(samples, peer)
            )
            summary[f"decode_speedup_over_{suffix}"] = _speedup_over(
                summary,
                samples,
                _speeds(samples, peer, "decode_tokens_per_second"),
                "decode_tokens_per_second",
            )


def _run_config(
    workload: _Workload,
    method_names: Sequence[str],
    orders: list[list[str]],
    *,
    pair,
    llamacpp_engine,
    dataset: str,
    baseline: str,
    warmup: bool,
    repeats: int,
) -> dict:
    """The report's ``config``: what ran, on what, and how it was timed."""
    from flyspec.bench.report import decoding_settings

    config = workload.config
    return {
        "dataset": dataset,
        "prompts": len(workload.prompts),
        "methods": list(method_names),
        **decoding_settings(config),
        "max_ngram": config.max_ngram,
        "mla_proposals": config.mla_proposals,
        "draft_confidence": config.draft_confidence,
        "baseline": baseline,
        "target": pair.target_name,
        "draft": pair.draft_name,
        "llamacpp": None if llamacpp_engine is None else llamacpp_engine.kernels,
        "warmup": warmup,
        "repeats": repeats,
        "method_order_per_repeat": orders,
        "timing": "wall time of each call (prefill included), interleaved per prompt; "
        "each repeat rotates the method order",
    }


LLAMACPP_BASELINE = "llamacpp-target"
LLAMA_SERVER_BASELINE = "llama-server"


class MethodFailures:
    """The methods that failed, each with a one-line reason: a failing method is dropped and
    the run goes on, except the baseline, which every speedup needs (its failure ends the run
    with that reason)."""

    def __init__(self, baseline: str) -> None:
        self.baseline = baseline
        self.reasons: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.reasons

    @contextlib.contextmanager
    def catch(self, name: str, *, during: str) -> Iterator[None]:
        try:
            yield
        except FlyspecError as error:
            self._failed(name, during, str(error))
        except Exception as error:  # a method's engine may fail in any way: keep the others
            self._failed(name, during, f"{type(error).__name__}: {error}")

    def _failed(self, name: str, during: str, reason: str) -> None:
        reason = " ".join(reason.split())  # one line
        if name == self.baseline:
            raise FlyspecError(f"the baseline {name} failed during {during}: {reason}")
        print(f"flyspec: {name} failed during {during}: {reason}", file=sys.stderr)
        self.reasons[name] = f"failed during {during}: {reason}"

    def as_list(self) -> list[dict]:
        return [{"method": name, "reason": reason} for name, reason in self.reasons.items()]


def reference_method(name: str, method_names: Sequence[str], baseline: str) -> str:
    """The method whose outputs ``name``'s are compared with, token for token: llama.cpp's
    plain decoding, by its server for the server's methods and by its binding for the
    binding's (where it runs), else the baseline."""
    base = method_base(name)
    if base in LLAMA_SERVER_METHOD_NAMES and LLAMA_SERVER_BASELINE in method_names:
        return LLAMA_SERVER_BASELINE
    if base in LLAMACPP_METHODS and LLAMACPP_BASELINE in method_names:
        return LLAMACPP_BASELINE
    return baseline


def _speeds(samples: dict, name: str, key: str = "tokens_per_second") -> list[float | None]:
    return [r[key] for r in samples[name]]


def console_notes(report: dict) -> list[str]:
    """What the console says under the table: the machine, its load (a warning when it was
    busy) and the prompts whose repeats disagree."""
    from flyspec.bench.report import machine_line, unstable_line
    from flyspec.support.machine import CpuLoad

    notes = [f"machine: {machine_line(report['environment'])}"]
    if report.get("machine_load"):
        load = CpuLoad.from_dict(report["machine_load"])
        notes.append(("warning: " if load.busy else "") + f"during the run {load.describe()}")
    unstable = unstable_line(report["methods"])
    if unstable:
        notes.append(f"warning: {unstable}")
    for failure in report.get("failed_methods") or []:
        notes.append(f"warning: {failure['method']} {failure['reason']}")
    return notes


def lossless_warnings(report: dict) -> list[str]:
    """One warning per lossless method whose greedy outputs differ from its baseline's."""
    if report["config"].get("temperature", 0) != 0:
        return []
    return [
        f"{summary['method']} is lossless but "
        f"{summary['samples'] - summary['identical_to_target']} of its outputs differ from its "
        "baseline's"
        for summary in report["methods"]
        if method_base(summary["method"]) in LOSSLESS_METHODS
        and summary["identical_to_target"] < summary["samples"]
    ]


def add_flyspec_methods(report: dict, own: dict, *, engine_settings: dict) -> None:
    """Merge a :func:`run_benchmark` report of flyspec's methods into a vLLM report, their
    speedups re-expressed over vllm-target (the one over flyspec's target kept beside)."""
    vllm_target_speed = [
        r["tokens_per_second"] for r in report["samples"][report["config"]["baseline"]]
    ]
    for summary in own["methods"]:
        summary["speedup_over_target"] = summary["speedup"]
        summary["speedup"] = _speedup_over(summary, own["samples"], vllm_target_speed)
    report["methods"] += own["methods"]
    report["samples"].update(own["samples"])
    report["config"]["flyspec"] = engine_settings


def _speedup_over(
    summary: dict,
    samples: dict,
    baseline_speed: list[float | None],
    key: str = "tokens_per_second",
) -> float | None:
    """The mean of ``summary``'s method's per-sample ``key`` speeds over that of the
    baseline's; None without a baseline, or where a speed is not known."""
    from flyspec.decoding.stats import mean_speedup

    speed = [r[key] for r in samples[summary["method"]]]
    if None in speed or None in baseline_speed:
        return None
    value = mean_speedup(speed, baseline_speed)
    return None if math.isnan(value) else round(value, 4)  # nan: no baseline
