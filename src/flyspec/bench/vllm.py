"""``flyspec bench --engine vllm``: vLLM's target alone, its exact speculative decoding and
FLy (vLLM's own where built in, flyspec's plugin elsewhere), at the same K, beside flyspec's
own engine.

vLLM's methods cannot be interleaved per prompt: each is one engine (40-70 s to start on a
CPU, a few GB of memory), so they run one after another, each over all prompts after a warm-up
generation: first one request at a time (batch 1, timed per prompt like flyspec's methods),
then with ``concurrency`` requests in flight (throughput: all new tokens over the wall time).
flyspec's methods then run interleaved among themselves as in :func:`run_benchmark`.

tau, acceptance and loosely accepted tokens of vLLM's methods come from vLLM's own metrics
(:mod:`flyspec.integrations.vllm.engine` reads them), taken before and after each prompt.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flyspec.bench.methods import SampleRun, measured_run
from flyspec.errors import FlyspecError
from flyspec.integrations.vllm.engine import VllmEngine, VllmStats, read_spec_decode_stats
from flyspec.integrations.vllm.launch import VllmEngineSpec
from flyspec.support.console import say

VLLM_METHODS: dict[str, str] = {"vllm-target": "target", "vllm-spd": "spd", "vllm-fly": "fly"}
"""Method name -> mode of the vLLM engine."""


class VllmMethod(VllmEngine):
    """One vLLM engine of a benchmark, named and described as the report shows it."""

    def __init__(self, name: str, spec: VllmEngineSpec, sampling) -> None:
        super().__init__(spec, sampling)
        self.name = name
        self.settings = {"engine": "vllm", "mode": spec.mode}
        if spec.mode != "target":
            self.settings.update(drafter=spec.drafter, k=spec.k)
        if spec.mode == "fly":
            self.settings.update(window=spec.fly.window, theta=spec.fly.theta)

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        before = read_spec_decode_stats(self.llm)
        params = self.params(max_new_tokens=max_new_tokens, seed=seed)
        started = time.perf_counter()
        (tokens,) = self.generate([prompt_ids], params)
        seconds = time.perf_counter() - started
        return SampleRun(tokens, seconds, read_spec_decode_stats(self.llm) - before)

    def run_concurrent(
        self, prompts_ids: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int | None
    ) -> tuple[int, float]:
        """All prompts submitted at once (the engine keeps ``max_num_seqs`` in flight):
        (new tokens, wall seconds)."""
        params = self.params(max_new_tokens=max_new_tokens, seed=seed)
        started = time.perf_counter()
        outputs = self.generate(prompts_ids, params)
        return sum(len(tokens) for tokens in outputs), time.perf_counter() - started


@dataclass
class VllmRuns:
    """What one vLLM method measured."""

    name: str
    settings: dict
    start_seconds: float
    samples: list[SampleRun]
    concurrent: tuple[int, float] | None


def run_vllm_methods(
    methods: Sequence[VllmMethod],
    prompts_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    seed: int | None,
    concurrency: int,
    warmup_tokens: int,
    progress: bool = True,
) -> list[VllmRuns]:
    """Each method in turn: start its engine, warm up, batch 1 over all prompts, then all
    prompts with ``concurrency`` in flight (when > 1), stop the engine."""
    from tqdm import tqdm

    results = []
    for method in methods:
        say(f"starting vLLM for {method.name} ...")
        start_seconds = method.start()
        try:
            say(f"{method.name}: engine started in {start_seconds:.0f}s; warming up ...")
            method.run(prompts_ids[0], max_new_tokens=warmup_tokens, seed=seed)
            samples = []
            for index, ids in enumerate(
                tqdm(prompts_ids, desc=method.name, file=sys.stderr, disable=not progress)
            ):
                sample_seed = None if seed is None else seed + index
                samples.append(
                    measured_run(method, ids, max_new_tokens=max_new_tokens, seed=sample_seed)
                )
            concurrent = None
            if concurrency > 1:
                say(f"{method.name}: {len(prompts_ids)} prompts, {concurrency} in flight ...")
                concurrent = method.run_concurrent(
                    prompts_ids, max_new_tokens=max_new_tokens, seed=seed
                )
        finally:
            method.close()
        results.append(VllmRuns(method.name, method.settings, start_seconds, samples, concurrent))
    return results


def make_vllm_methods(
    names: Sequence[str], base: VllmEngineSpec, sampling, *, concurrency: int
) -> list[VllmMethod]:
    """The engines of the named vLLM methods, alike but for their mode."""
    unknown = [name for name in names if name not in VLLM_METHODS]
    if unknown:
        raise FlyspecError(f"not vLLM methods: {', '.join(unknown)}")
    # No prefix caching: each prompt is prefilled in full, as in flyspec's engine, and the
    # in-flight pass does not reuse the batch-1 pass's prompts.
    spec = replace(base, max_num_seqs=max(concurrency, 1), prefix_caching=False)
    return [VllmMethod(name, replace(spec, mode=VLLM_METHODS[name]), sampling) for name in names]


def summarise_vllm_runs(
    runs: VllmRuns,
    records: Sequence[dict],
    baseline_tokens_per_second: Sequence[float],
    *,
    k: int,
) -> dict:
    """One vLLM method's summary from its per-sample records (as
    :func:`~flyspec.bench.report.summarise_method`), plus tau, acceptance and loosely accepted
    tokens from vLLM's metrics, and the throughput with several requests in flight."""
    from flyspec.bench.report import summarise_method

    summary = summarise_method(
        runs.name, records, None, baseline_tokens_per_second, k=k, settings=runs.settings
    )
    summary["kind"] = "vllm"
    summary["engine_start_seconds"] = round(runs.start_seconds, 1)
    pooled = sum((run.stats for run in runs.samples), VllmStats())
    if pooled.rounds:
        figures = pooled.as_dict()
        summary.update(
            rounds=figures["rounds"],
            tau=figures["tau"],
            drafted=figures["drafted"],
            accepted=figures["accepted"],
            loosely_accepted=figures["loosely_accepted"],
            acceptance_rate=round(figures["accepted"] / pooled.drafted, 4),
            loose_acceptance_rate=round(figures["loosely_accepted"] / pooled.drafted, 4),
            per_position_acceptance=pooled.per_position_acceptance(),
        )
    if runs.concurrent is not None:
        tokens, seconds = runs.concurrent
        summary["concurrent_tokens_per_second"] = round(tokens / seconds, 4)
    return summary


def run_vllm_benchmark(
    spec: VllmEngineSpec,
    method_names: Sequence[str],
    prompts: Sequence,
    tokenizer,
    config,
    *,
    concurrency: int,
    progress: bool,
    dataset: str,
    chat: bool,
) -> dict:
    """vLLM's methods (``vllm-target`` first) one engine after another on ``prompts``
    (:class:`~flyspec.bench.prompts.BenchPrompt`), each at batch 1 after a warm-up and then
    with ``concurrency`` requests in flight; the report, its speedups over vllm-target."""
    from flyspec.bench.prompts import encode_prompts
    from flyspec.bench.report import decoding_settings, environment, sample_records

    methods = make_vllm_methods(method_names, spec, config.sampling, concurrency=concurrency)
    prompts_ids = encode_prompts(tokenizer, prompts)
    runs = run_vllm_methods(
        methods,
        prompts_ids,
        max_new_tokens=config.max_new_tokens,
        seed=config.sampling.seed,
        concurrency=concurrency,
        warmup_tokens=min(config.max_new_tokens, 2 * (config.k + 1)),
        progress=progress,
    )
    baseline = runs[0]
    samples = {
        run.name: sample_records(
            prompts,
            prompts_ids,
            run.samples,
            baseline.samples,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        for run in runs
    }
    baseline_speed = [r["tokens_per_second"] for r in samples[baseline.name]]
    return {
        "config": {
            "dataset": dataset,
            "prompts": len(prompts),
            "methods": list(method_names),
            "baseline": baseline.name,
            **decoding_settings(config),
            "concurrency": concurrency,
            "target": spec.target,
            "draft": spec.draft,
            "vllm": {"dtype": spec.dtype or "auto", "max_model_len": spec.max_model_len},
            "chat": chat,
            "timing": "vLLM methods one engine after another, each prompt at batch 1 after "
            "a warm-up, then all prompts with `concurrency` in flight; flyspec's methods "
            "after them, interleaved per prompt",
        },
        "environment": environment(),
        "methods": [
            summarise_vllm_runs(run, samples[run.name], baseline_speed, k=config.k) for run in runs
        ],
        "prompts": [prompt.as_dict() for prompt in prompts],
        "samples": samples,
    }
