"""Run every method on the same problems: generate (or take from the cache), then score.

Problems are visited one at a time and every method runs on a problem before the next problem
starts, so slow drifts of the machine's load hit all methods alike.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from flyspec.config import DecodeConfig, FlyConfig
from flyspec.decoding.stats import RequestStats
from flyspec.evaluation.cache import GenerationCache, generation_key
from flyspec.evaluation.tasks import Outcome, Task
from flyspec.models.identity import model_identity


@dataclass(frozen=True)
class EvalMethod:
    """One way of decoding: the target alone, exact SPD, or FLy with one rule (``fly``: the
    paper's gate and window, and the optional rules beyond it)."""

    name: str
    mode: str
    fly: FlyConfig | None = None

    @property
    def label(self) -> str:
        if self.mode == "target":
            return "target"
        if self.mode == "spd":
            return "SPD"
        return fly_label(self.fly)

    def config(self, base: DecodeConfig) -> DecodeConfig:
        if self.mode != "fly":
            return base.with_updates(mode=self.mode)
        return base.with_updates(mode="fly", fly=self.fly)

    def as_dict(self) -> dict:
        rule = {} if self.fly is None else asdict(self.fly)
        return {
            "name": self.name,
            "label": self.label,
            "mode": self.mode,
            "theta": rule.get("theta"),
            "window": rule.get("window"),
            "min_ratio": rule.get("min_ratio"),
            "max_rank": rule.get("max_rank"),
            "max_draft_confidence": rule.get("max_draft_confidence"),
            "defer": rule.get("defer"),
        }


def _rule_parts(fly: FlyConfig) -> list[tuple[str, str]]:
    """(name part, label part) of each setting that tells FLy methods apart: theta, W, and
    the rules beyond the paper that are on."""
    parts = [(f"theta{fly.theta:g}", f"θ={fly.theta:g}"), (f"w{fly.window}", f"W={fly.window}")]
    if fly.min_ratio > 0:
        parts.append((f"ratio{fly.min_ratio:g}", f"ratio≥{fly.min_ratio:g}"))
    if fly.max_rank > 0:
        parts.append((f"rank{fly.max_rank}", f"top-{fly.max_rank}"))
    if fly.max_draft_confidence < 1:
        value = f"{fly.max_draft_confidence:g}"
        parts.append((f"doubt{value}", f"draft≤{value}"))
    if fly.defer:
        parts.append(("defer", "deferred"))
    return parts


def fly_label(fly: FlyConfig) -> str:
    """``FLy θ=0.3 W=6``, with ``ratio≥r``, ``top-n``, ``draft≤c``, ``deferred`` for the rules
    on."""
    return "FLy " + " ".join(label for _, label in _rule_parts(fly))


def fly_name(fly: FlyConfig) -> str:
    """``fly-theta0.3-w6``, with ``-ratio<r>``, ``-rank<n>``, ``-doubt<c>``, ``-defer`` for the
    rules on."""
    return "fly-" + "-".join(name for name, _ in _rule_parts(fly))


def build_methods(
    modes: Sequence[str], base: FlyConfig, rules: Mapping[str, Sequence] | None = None
) -> list[EvalMethod]:
    """``target``, ``spd`` and one ``fly`` method per combination of the FLy settings in
    ``rules`` (field of :class:`FlyConfig` -> values; the others from ``base``): named ``fly``
    when there is only one combination, else by :func:`fly_name`."""
    rules = {name: list(dict.fromkeys(values)) for name, values in (rules or {}).items()}
    combos = [
        replace(base, **dict(zip(rules, values, strict=True)))
        for values in itertools.product(*rules.values())
    ]
    methods: list[EvalMethod] = []
    for mode in dict.fromkeys(modes):
        if mode in ("target", "spd"):
            methods.append(EvalMethod(mode, mode))
            continue
        for fly in combos:
            methods.append(EvalMethod("fly" if len(combos) == 1 else fly_name(fly), "fly", fly))
    return methods


@dataclass(frozen=True)
class TaskRun:
    """A task, its problems (from index ``first`` of its dataset) and the token budget of
    one generation."""

    task: Task
    problems: Sequence
    max_new_tokens: int
    first: int = 0

    def config(self, method: EvalMethod, base: DecodeConfig, *, chat: bool) -> DecodeConfig:
        """``method``'s settings on this task: its token budget and stop strings added."""
        return method.config(base).with_updates(
            max_new_tokens=self.max_new_tokens,
            stop=tuple(dict.fromkeys(base.stop + self.task.stop_strings(chat=chat))),
        )


@dataclass
class Sample:
    """One method's generation on one problem, scored."""

    task: str
    problem_id: str
    method: str
    text: str
    stats: dict
    finish_reason: str | None
    cached: bool
    key: str
    outcome: Outcome
    token_ids: list[int] = field(default_factory=list)
    loose_tokens: list[dict] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return float(self.stats.get("tokens_per_second") or 0.0)

    def as_dict(self, *, with_text: bool = True) -> dict:
        data = {
            "task": self.task,
            "problem_id": self.problem_id,
            "method": self.method,
            "correct": self.outcome.correct,
            "outcome": self.outcome.label,
            "outcome_detail": self.outcome.detail,
            "finish_reason": self.finish_reason,
            "cached": self.cached,
            "cache_key": self.key,
            "stats": self.stats,
        }
        if self.loose_tokens:
            data["loose_tokens"] = self.loose_tokens
        if with_text:
            data["text"] = self.text
        return data


@dataclass
class EngineIdentity:
    target: dict
    draft: dict | None
    dtype: str
    device: str
    kernels: dict

    def generation_key(
        self,
        task: Task,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        prediction_ids: Sequence[int] | None = None,
    ) -> str:
        """The cache key of one generation by this engine."""
        return generation_key(
            prediction_ids=prediction_ids,
            task_version=task.version,
            prompt_ids=prompt_ids,
            config=config,
            target=self.target,
            draft=self.draft,
            dtype=self.dtype,
            device=self.device,
            kernels=self.kernels,
        )

    @classmethod
    def of(cls, engine) -> EngineIdentity:
        """The identity of a loaded engine; on the llama.cpp backend the weights are the GGUF
        files' own (``dtype`` "gguf") and run on the CPU."""
        if engine.target_model is None:
            dtype, device = "gguf", "cpu"
        else:
            parameter = next(engine.target_model.parameters())
            dtype, device = str(parameter.dtype).removeprefix("torch."), str(parameter.device)
        return cls(
            target=model_identity(str(engine.target_name)),
            draft=None if engine.draft_name is None else model_identity(str(engine.draft_name)),
            dtype=dtype,
            device=device,
            kernels=dict(engine.kernels),
        )


ProgressHook = Callable[[Sample], None]


def evaluate(
    engine,
    runs: Sequence[TaskRun],
    methods: Sequence[EvalMethod],
    base: DecodeConfig,
    *,
    cache: GenerationCache,
    chat: bool,
    progress: bool = True,
    on_sample: ProgressHook | None = None,
) -> list[Sample]:
    """Generate and score every (problem, method) pair; cached generations are reused."""
    from tqdm import tqdm

    identity = EngineIdentity.of(engine)
    total = sum(len(run.problems) for run in runs) * len(methods)
    warmed: set[str] = set()
    samples: list[Sample] = []
    bar = tqdm(total=total, file=sys.stderr, disable=not progress, unit="gen", dynamic_ncols=True)
    try:
        for run in runs:
            task = run.task
            for problem in run.problems:
                problem_id = task.problem_id(problem)
                prompt = task.prompt(problem, chat=chat)
                prompt_ids = prompt.token_ids(engine.tokenizer)
                prediction_ids = prompt.prediction_ids(engine.tokenizer)
                for method in methods:
                    bar.set_postfix_str(f"{problem_id} {method.name}", refresh=False)
                    config = run.config(method, base, chat=chat)
                    key = identity.generation_key(task, prompt_ids, config, prediction_ids)
                    entry = cache.get(key, config)
                    cached = entry is not None
                    if entry is None:
                        if config.mode not in warmed:
                            _warm_up(engine, prompt_ids, config)
                            warmed.add(config.mode)
                        entry = _generate(
                            engine, prompt_ids, config, task.is_complete, prediction_ids
                        )
                        entry.update(
                            task=task.name,
                            task_version=task.version,
                            problem_id=problem_id,
                            method=method.as_dict(),
                        )
                        cache.put(key, entry)
                    outcome = task.score(problem, entry["text"], chat=chat)
                    sample = Sample(
                        task=task.name,
                        problem_id=problem_id,
                        method=method.name,
                        text=entry["text"],
                        stats=entry["stats"],
                        finish_reason=entry.get("finish_reason"),
                        cached=cached,
                        key=key,
                        outcome=outcome,
                        token_ids=list(entry.get("token_ids", [])),
                        loose_tokens=list(entry.get("loose_tokens", [])),
                    )
                    samples.append(sample)
                    if on_sample is not None:
                        on_sample(sample)
                    bar.update(1)
    finally:
        bar.close()
    return samples


def _warm_up(engine, prompt_ids: Sequence[int], config: DecodeConfig) -> None:
    """A couple of tokens first, so one-time costs do not land on the first timed sample."""
    engine.generate(prompt_ids, config.with_updates(max_new_tokens=2, stop=()))


def _generate(
    engine,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    is_complete: Callable[[str], bool],
    prediction_ids: Sequence[int] | None = None,
) -> dict:
    """One generation, stopped early once the task says the answer is complete; drafted from
    ``prediction_ids`` first where the task gives a prediction."""
    stats = RequestStats()
    pieces: list[str] = []
    token_ids: list[int] = []
    text = ""
    answered = False
    stream = engine.stream(prompt_ids, config, stats=stats, prediction=prediction_ids)
    try:
        for chunk in stream:
            if chunk.token is not None:
                token_ids.append(chunk.token)
            if chunk.text:
                pieces.append(chunk.text)
                text += chunk.text
                if is_complete(text):
                    answered = True
                    break
    finally:
        stream.close()
    summary = stats.as_dict()
    if not math.isfinite(summary.get("tokens_per_second", 0.0)):
        summary["tokens_per_second"] = 0.0
    return {
        "text": "".join(pieces),
        "token_ids": token_ids,
        "max_new_tokens": config.max_new_tokens,
        "prompt_tokens": len(prompt_ids),
        "stats": summary,
        "loose_tokens": [
            asdict(token) for token in stats.loose_tokens if token.output_index < len(token_ids)
        ],
        "finish_reason": "answer" if answered else stats.finish_reason,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
