"""One vLLM engine in this process (``vllm.LLM``) for a :class:`VllmEngineSpec`: start it,
generate token ids, read its speculative-decoding counts, stop it. ``flyspec bench --engine
vllm`` and ``flyspec eval --engine vllm`` both run their engines through it.

tau, acceptance and loosely accepted tokens come from vLLM's own metrics
(``LLM.get_metrics()``, which the plugin's counter joins); differences of the running totals
give a request's or a batch's counts. Nothing here imports vLLM at module load.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from flyspec.integrations.vllm.launch import VllmEngineSpec, engine_environment

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


class VllmEngine:
    """One vLLM engine sampling as ``sampling`` says: started by :meth:`start`, stopped by
    :meth:`close`."""

    def __init__(self, spec: VllmEngineSpec, sampling) -> None:
        self.spec = spec
        self.sampling = sampling
        self.llm = None

    def start(self) -> float:
        """Start the engine; returns the seconds it took."""
        from vllm import LLM

        os.environ.update(engine_environment(os.environ))
        started = time.perf_counter()
        self.llm = LLM(**self.spec.llm_kwargs())
        return time.perf_counter() - started

    def params(self, *, max_new_tokens: int, seed: int | None, stop: Sequence[str] = ()):
        """vLLM's ``SamplingParams`` for one request."""
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

    def completions(self, prompts_ids: Sequence[Sequence[int]], params) -> list:
        """vLLM's first completion of each prompt (``params``: one, or one per prompt)."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts_ids],
            params,
            use_tqdm=False,
        )
        return [output.outputs[0] for output in outputs]

    def generate(self, prompts_ids: Sequence[Sequence[int]], params) -> list[list[int]]:
        """The new token ids of each prompt."""
        return [new_tokens(completion) for completion in self.completions(prompts_ids, params)]

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
            self.params(max_new_tokens=budget, seed=seed, stop=stop)
            for budget, stop in zip(max_new_tokens, stops, strict=True)
        ]
        before = read_spec_decode_stats(self.llm)
        started = time.perf_counter()
        completions = self.completions(prompts_ids, params)
        seconds = time.perf_counter() - started
        results = [(new_tokens(c), c.finish_reason or "") for c in completions]
        return results, seconds, read_spec_decode_stats(self.llm) - before

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
