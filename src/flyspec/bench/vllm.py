"""``flyspec bench --engine vllm``: vLLM's target alone, its exact speculative decoding and
FLy (vLLM's own where built in, flyspec's plugin elsewhere), at the same K, beside flyspec's
own engine.

vLLM's methods cannot be interleaved per prompt: each is one engine (40-70 s to start on a
CPU, a few GB of memory), so they run one after another, each over all prompts after a warm-up
generation: first one request at a time (batch 1, timed per prompt like flyspec's methods),
then with ``concurrency`` requests in flight (throughput: all new tokens over the wall time).
flyspec's methods then run interleaved among themselves as in :func:`run_benchmark`.

tau, acceptance and loosely accepted tokens of vLLM's methods come from vLLM's own metrics
(``LLM.get_metrics()``, which the plugin's counter joins), taken before and after each prompt.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flyspec.bench.methods import SampleRun, measured_run
from flyspec.errors import FlyspecError
from flyspec.integrations.vllm.launch import VllmEngineSpec, engine_environment

VLLM_METHODS: dict[str, str] = {"vllm-target": "target", "vllm-spd": "spd", "vllm-fly": "fly"}
"""Method name -> mode of the vLLM engine."""

SPEC_DECODE_METRICS = {
    "vllm:spec_decode_num_drafts": "rounds",
    "vllm:spec_decode_num_draft_tokens": "drafted",
    "vllm:spec_decode_num_accepted_tokens": "accepted_with_loose",
    "vllm:spec_decode_num_loosely_accepted_tokens": "loosely_accepted",
}


PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class VllmStats:
    """Speculative-decoding counts of one request (or a running total), from vLLM's
    metrics."""

    rounds: int = 0
    drafted: int = 0
    accepted_with_loose: int = 0  # vLLM counts loosely accepted tokens as accepted
    loosely_accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()  # kept at draft position i, over all rounds

    def combine(self, other: VllmStats, sign: int) -> VllmStats:
        """``self + sign * other``, field by field."""
        positions = max(len(self.accepted_per_position), len(other.accepted_per_position))

        def padded(values: tuple[int, ...]) -> list[int]:
            return list(values) + [0] * (positions - len(values))

        return VllmStats(
            **{
                name: getattr(self, name) + sign * getattr(other, name)
                for name in SPEC_DECODE_METRICS.values()
            },
            accepted_per_position=tuple(
                a + sign * b
                for a, b in zip(
                    padded(self.accepted_per_position),
                    padded(other.accepted_per_position),
                    strict=True,
                )
            ),
        )

    def __sub__(self, earlier: VllmStats) -> VllmStats:
        return self.combine(earlier, -1)

    def __add__(self, other: VllmStats) -> VllmStats:
        return self.combine(other, 1)

    def per_position_acceptance(self) -> list[float]:
        """P(kept at draft position i) per round (every round drafts all K positions)."""
        return [round(kept / self.rounds, 4) for kept in self.accepted_per_position]

    def as_dict(self) -> dict:
        exact = self.accepted_with_loose - self.loosely_accepted
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": exact,
            "loosely_accepted": self.loosely_accepted,
            "tau": round(1 + self.accepted_with_loose / self.rounds, 4) if self.rounds else None,
        }


def read_spec_decode_stats(llm) -> VllmStats:
    """The engine's running speculative-decoding counts."""
    totals = dict.fromkeys(SPEC_DECODE_METRICS.values(), 0)
    per_position: tuple[int, ...] = ()
    for metric in llm.get_metrics():
        field = SPEC_DECODE_METRICS.get(metric.name)
        if field is not None and hasattr(metric, "value"):
            totals[field] += int(metric.value)
        elif metric.name == PER_POSITION_METRIC and hasattr(metric, "values"):
            per_position = tuple(int(v) for v in metric.values)
    return VllmStats(**totals, accepted_per_position=per_position)


class VllmMethod:
    """One vLLM engine of a benchmark: started by :meth:`start`, stopped by :meth:`close`."""

    def __init__(self, name: str, spec: VllmEngineSpec, sampling) -> None:
        self.name = name
        self.spec = spec
        self.sampling = sampling
        self.llm = None
        self.settings = {"engine": "vllm", "mode": spec.mode}
        if spec.mode != "target":
            self.settings.update(drafter=spec.drafter, k=spec.k)
        if spec.mode == "fly":
            self.settings.update(window=spec.fly.window, theta=spec.fly.theta)

    def start(self) -> float:
        """Start the engine; returns the seconds it took."""
        from vllm import LLM

        os.environ.update(engine_environment(os.environ))
        started = time.perf_counter()
        self.llm = LLM(**self.spec.llm_kwargs())
        return time.perf_counter() - started

    def _params(self, *, max_new_tokens: int, seed: int | None, stop: Sequence[str] = ()):
        from vllm import SamplingParams

        sampling = self.sampling
        return SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k or -1 if sampling.temperature else -1,
            top_p=sampling.top_p,
            max_tokens=max_new_tokens,
            seed=seed,
            stop=list(stop) or None,
        )

    def _completions(self, prompts_ids: Sequence[Sequence[int]], params) -> list:
        """vLLM's first completion of each prompt (``params``: one, or one per prompt)."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts_ids],
            params,
            use_tqdm=False,
        )
        return [output.outputs[0] for output in outputs]

    def _generate(self, prompts_ids: Sequence[Sequence[int]], params) -> list[list[int]]:
        return [new_tokens(completion) for completion in self._completions(prompts_ids, params)]

    def run_all(
        self,
        prompts_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: Sequence[int],
        stops: Sequence[Sequence[str]],
        seed: int | None,
    ) -> tuple[list[tuple[list[int], str]], float, VllmStats]:
        """Every prompt at once, each with its own token budget and stop strings: per prompt
        (new tokens, vLLM's finish reason), the wall seconds, and the speculative-decoding
        counts of the whole batch."""
        params = [
            self._params(max_new_tokens=budget, seed=seed, stop=stop)
            for budget, stop in zip(max_new_tokens, stops, strict=True)
        ]
        before = read_spec_decode_stats(self.llm)
        started = time.perf_counter()
        completions = self._completions(prompts_ids, params)
        seconds = time.perf_counter() - started
        results = [(new_tokens(c), c.finish_reason or "") for c in completions]
        return results, seconds, read_spec_decode_stats(self.llm) - before

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        before = read_spec_decode_stats(self.llm)
        params = self._params(max_new_tokens=max_new_tokens, seed=seed)
        started = time.perf_counter()
        (tokens,) = self._generate([prompt_ids], params)
        seconds = time.perf_counter() - started
        return SampleRun(tokens, seconds, read_spec_decode_stats(self.llm) - before)

    def run_concurrent(
        self, prompts_ids: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int | None
    ) -> tuple[int, float]:
        """All prompts submitted at once (the engine keeps ``max_num_seqs`` in flight):
        (new tokens, wall seconds)."""
        params = self._params(max_new_tokens=max_new_tokens, seed=seed)
        started = time.perf_counter()
        outputs = self._generate(prompts_ids, params)
        return sum(len(tokens) for tokens in outputs), time.perf_counter() - started

    def close(self) -> None:
        """Stop the engine's processes and free its memory before the next one starts."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()


def new_tokens(completion) -> list[int]:
    """A completion's new token ids without the end-of-sequence token vLLM appends when it
    stopped there (flyspec's methods never emit it)."""
    tokens = list(completion.token_ids)
    if completion.finish_reason == "stop" and completion.stop_reason is None and tokens:
        tokens = tokens[:-1]
    return tokens


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


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
