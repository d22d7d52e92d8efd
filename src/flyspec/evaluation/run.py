"""One ``flyspec eval`` run: every method on every chosen problem of every task, through the
generation cache, then the report files (eval.json, eval.md, tradeoff.png, loosening.png)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flyspec.config import DecodeConfig
from flyspec.errors import FlyspecError
from flyspec.support.console import say

if TYPE_CHECKING:
    from flyspec.evaluation.runner import EngineIdentity, EvalMethod
    from flyspec.integrations.vllm.launch import VllmEngineSpec

TASKS = ("humaneval", "humaneval-edit", "gsm8k")
DEFAULT_TASKS = ("humaneval", "gsm8k")
PROMPT_STYLES = ("auto", "chat", "raw")


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation runs besides the decoding settings.

    ``limits``: task name (or ``*`` for every task) -> the problems ``start`` to ``end - 1``;
    a task without one takes its default count from the start. ``max_new_tokens``: the token
    budget per generation, None for each task's default. ``cache_dir``: the generation cache,
    None for none.
    """

    tasks: Sequence[str]
    methods: Sequence[EvalMethod]
    limits: Mapping[str, tuple[int, int]]
    max_new_tokens: int | None = None
    prompt_style: str = "auto"
    cache_dir: Path | None = None
    exec_timeout_s: float = 10.0
    exec_memory_mb: int = 1024
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.tasks:
            raise FlyspecError("no task to evaluate")
        for name in self.tasks:
            if name not in TASKS:
                raise FlyspecError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
        if not self.methods:
            raise FlyspecError("no method to evaluate")
        if self.prompt_style not in PROMPT_STYLES:
            raise FlyspecError(
                f"prompt_style must be one of {', '.join(PROMPT_STYLES)}, got {self.prompt_style!r}"
            )
        if self.exec_timeout_s <= 0 or self.exec_memory_mb <= 0:
            raise FlyspecError(
                "the limits of a program's execution must be positive, got a time limit of "
                f"{self.exec_timeout_s:g} s and a memory limit of {self.exec_memory_mb} MiB"
            )


def run_evaluation(
    settings: EvalSettings,
    base: DecodeConfig,
    *,
    load_engine: Callable[[bool], object],
    output: Path,
    command: str,
    problems: Mapping[str, Sequence] | None = None,
    vllm_spec: VllmEngineSpec | None = None,
) -> dict:
    """Run the evaluation, write its files into ``output`` and return eval.json's payload.

    ``base``: the decoding settings every method starts from (mode and FLy rule are each
    method's own). ``load_engine(with_draft)`` loads the model pair, once the cheap checks
    have passed. ``problems`` (task name -> problems) replaces the datasets, for tests and
    custom problem sets. ``command`` is recorded as the command that reproduces the run.
    ``vllm_spec``: generate with vLLM engines like this one instead
    (:mod:`flyspec.evaluation.on_vllm`; ``load_engine`` is then not called).
    """
    from flyspec.evaluation.cache import GenerationCache

    sandbox = _sandbox(settings.tasks)
    runs = _task_runs(settings, problems)
    output.mkdir(parents=True, exist_ok=True)
    cache = GenerationCache(settings.cache_dir)
    engine, tokenizer = _load_models(settings, base, load_engine, vllm_spec)
    chat = _uses_chat_template(tokenizer, settings.prompt_style)
    started = time.perf_counter()
    if vllm_spec is None:
        generated = _generate_on_flyspec(engine, runs, settings, base, cache=cache, chat=chat)
    else:
        generated = _generate_on_vllm(
            vllm_spec, runs, settings, base, tokenizer=tokenizer, cache=cache, chat=chat
        )
    seconds = time.perf_counter() - started
    payload = _payload(
        settings,
        base,
        generated,
        command=command,
        seconds=seconds,
        runs=runs,
        chat=chat,
        sandbox=sandbox,
        cache=cache,
    )
    _write_reports(output, payload)
    return payload


@dataclass(frozen=True)
class _Generated:
    """The scored samples, what their generations depend on, and vLLM's engines (None where
    flyspec's engine generated)."""

    samples: list
    identity: EngineIdentity
    engines: dict | None = None


def _sandbox(tasks: Sequence[str]) -> dict | None:
    """The sandbox that runs HumanEval's programs, said on stderr; None without HumanEval."""
    if not any(name.startswith("humaneval") for name in tasks):
        return None
    from flyspec.evaluation.sandbox import sandbox_info

    # Before anything is written or loaded: a bad FLYSPEC_SANDBOX is a one-line error.
    sandbox = sandbox_info().as_dict()
    say(
        f"sandbox for HumanEval programs: {sandbox['backend']}, run-wide limits by "
        f"{sandbox['run_limits']} ({sandbox['interpreter']})"
    )
    for note in sandbox["notes"]:
        say(f"  note: {note}")
    return sandbox


def _task_runs(settings: EvalSettings, problems: Mapping[str, Sequence] | None) -> list:
    """Each task with its chosen problems and token budget."""
    from flyspec.evaluation.runner import TaskRun
    from flyspec.evaluation.tasks import load_problems, make_task

    runs = []
    for name in settings.tasks:
        task = make_task(name, timeout_s=settings.exec_timeout_s, memory_mb=settings.exec_memory_mb)
        limits = settings.limits
        start, end = limits.get(name, limits.get("*", (0, task.default_limit)))
        if problems is not None:
            chosen = list(problems.get(name, []))[start:end]
        else:
            chosen = list(load_problems(name, end))[start:]
        max_new_tokens = settings.max_new_tokens or task.default_max_new_tokens
        runs.append(TaskRun(task=task, problems=chosen, max_new_tokens=max_new_tokens, first=start))
    return runs


def _load_models(
    settings: EvalSettings,
    base: DecodeConfig,
    load_engine: Callable[[bool], object],
    vllm_spec: VllmEngineSpec | None,
) -> tuple[object, object]:
    """flyspec's engine (None where vLLM generates) and the tokenizer of the prompts."""
    if vllm_spec is None:
        engine = load_engine(any(m.config(base).uses_draft_model for m in settings.methods))
        return engine, engine.tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_spec.target)
    if "humaneval-edit" in settings.tasks:
        say("vLLM has no Predicted Outputs: its edits are generated without the prediction")
    return None, tokenizer


def _uses_chat_template(tokenizer, prompt_style: str) -> bool:
    """Whether prompts go through the tokenizer's chat template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = has_template if prompt_style == "auto" else prompt_style == "chat"
    if chat and not has_template:
        raise FlyspecError("prompt style chat: this tokenizer has no chat template")
    return chat


def _generate_on_flyspec(
    engine, runs: list, settings: EvalSettings, base: DecodeConfig, *, cache, chat: bool
) -> _Generated:
    """Every method on every problem, on flyspec's engine."""
    from flyspec.evaluation.runner import EngineIdentity, evaluate

    samples = evaluate(
        engine,
        runs,
        settings.methods,
        base,
        cache=cache,
        chat=chat,
        progress=settings.progress,
    )
    return _Generated(samples, EngineIdentity.of(engine))


def _generate_on_vllm(
    vllm_spec: VllmEngineSpec,
    runs: list,
    settings: EvalSettings,
    base: DecodeConfig,
    *,
    tokenizer,
    cache,
    chat: bool,
) -> _Generated:
    """Every method on every problem, on vLLM engines like ``vllm_spec``."""
    import vllm

    from flyspec.evaluation.on_vllm import evaluate_on_vllm, vllm_identity

    samples, engines = evaluate_on_vllm(
        vllm_spec,
        runs,
        settings.methods,
        base,
        tokenizer=tokenizer,
        vllm_version=vllm.__version__,
        cache=cache,
        chat=chat,
    )
    return _Generated(samples, vllm_identity(vllm_spec, vllm.__version__), engines)


def _payload(
    settings: EvalSettings,
    base: DecodeConfig,
    generated: _Generated,
    *,
    command: str,
    seconds: float,
    runs: list,
    chat: bool,
    sandbox: dict | None,
    cache,
) -> dict:
    """eval.json's content."""
    from flyspec.evaluation import loosening, report

    identity = generated.identity
    return {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": command,
        "seconds": round(seconds, 2),
        "models": {
            "target": identity.target,
            "draft": identity.draft,
            "dtype": identity.dtype,
            "device": identity.device,
            "kernels": identity.kernels,
        },
        "settings": _settings_record(settings, base, runs, chat=chat),
        "sandbox": sandbox,
        "cache": _cache_record(cache),
        "engine": "flyspec" if generated.engines is None else "vllm",
        "vllm_engines": generated.engines,
        "tasks": report.summarize(generated.samples, settings.methods, list(settings.tasks)),
        "loosening": loosening.analyse(generated.samples, settings.methods, list(settings.tasks)),
        "samples": [s.as_dict() for s in generated.samples],
    }


def _settings_record(settings: EvalSettings, base: DecodeConfig, runs: list, *, chat: bool) -> dict:
    """eval.json's ``settings``: the tasks' problems, the methods and the decoding."""
    from flyspec.evaluation.cache import decoding_identity

    return {
        "tasks": {
            run.task.name: {
                "problems": len(run.problems),
                "range": [run.first, run.first + len(run.problems)],
                "max_new_tokens": run.max_new_tokens,
                "version": run.task.version,
            }
            for run in runs
        },
        "methods": [m.as_dict() for m in settings.methods],
        "decoding": decoding_identity(base.with_updates(max_new_tokens=1)),
        "decoding_summary": _decoding_summary(base),
        "prompt_style": "chat template" if chat else "raw",
        "exec_timeout_s": settings.exec_timeout_s,
        "exec_memory_mb": settings.exec_memory_mb,
    }


def _cache_record(cache) -> dict:
    """eval.json's ``cache``: where it is and how much of the run it answered."""
    return {
        "dir": None if cache.folder is None else str(cache.folder),
        "hits": cache.hits,
        "misses": cache.misses,
        "note": "cached generations keep the timing statistics of the run that produced "
        "them; speedup and tokens/s are computed from those",
    }


def _write_reports(output: Path, payload: dict) -> None:
    """The plots (named in ``payload`` where drawn), eval.json and eval.md."""
    from flyspec.evaluation import loosening, report

    if report.plot_tradeoff(output / "tradeoff.png", payload):
        payload["plot"] = "tradeoff.png"
    if loosening.plot(output / "loosening.png", payload["loosening"]):
        payload["loosening_plot"] = "loosening.png"
    report.write_json(output / "eval.json", payload)
    (output / "eval.md").write_text(report.render_markdown(payload), encoding="utf-8")


def _decoding_summary(base) -> str:
    sampling = base.sampling
    how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    return f"{how}, drafter {base.drafter}, K={base.k}, entropy {base.fly.entropy}" + (
        f", extra stop strings {list(base.stop)}" if base.stop else ""
    )
