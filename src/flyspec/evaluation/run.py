"""One ``flyspec eval`` run: every method on every chosen problem of every task, through the
generation cache, then the report files (eval.json, eval.md, tradeoff.png, loosening.png)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flyspec.config import DecodeConfig
from flyspec.errors import FlyspecError

if TYPE_CHECKING:
    from flyspec.evaluation.runner import EvalMethod
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
    from flyspec.evaluation import loosening, report
    from flyspec.evaluation.cache import GenerationCache, decoding_identity
    from flyspec.evaluation.runner import EngineIdentity, TaskRun, evaluate
    from flyspec.evaluation.tasks import load_problems, make_task

    sandbox = None
    if any(name.startswith("humaneval") for name in settings.tasks):
        from flyspec.evaluation.sandbox import sandbox_info

        # Before anything is written or loaded: a bad FLYSPEC_SANDBOX is a one-line error.
        sandbox = sandbox_info().as_dict()
        _say(
            f"sandbox for HumanEval programs: {sandbox['backend']}, run-wide limits by "
            f"{sandbox['run_limits']} ({sandbox['interpreter']})"
        )
        for note in sandbox["notes"]:
            _say(f"  note: {note}")

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

    output.mkdir(parents=True, exist_ok=True)
    cache = GenerationCache(settings.cache_dir)
    if vllm_spec is None:
        engine = load_engine(any(m.config(base).uses_draft_model for m in settings.methods))
        tokenizer = engine.tokenizer
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_spec.target)
        if "humaneval-edit" in settings.tasks:
            _say("vLLM has no Predicted Outputs: its edits are generated without the prediction")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = has_template if settings.prompt_style == "auto" else settings.prompt_style == "chat"
    if chat and not has_template:
        raise FlyspecError("prompt style chat: this tokenizer has no chat template")

    started = time.perf_counter()
    engines = None
    if vllm_spec is None:
        samples = evaluate(
            engine,
            runs,
            settings.methods,
            base,
            cache=cache,
            chat=chat,
            progress=settings.progress,
        )
        identity = EngineIdentity.of(engine)
    else:
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
        identity = vllm_identity(vllm_spec, vllm.__version__)
    elapsed = time.perf_counter() - started

    payload = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": command,
        "seconds": round(elapsed, 2),
        "models": {
            "target": identity.target,
            "draft": identity.draft,
            "dtype": identity.dtype,
            "device": identity.device,
            "kernels": identity.kernels,
        },
        "settings": {
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
        },
        "sandbox": sandbox,
        "cache": {
            "dir": None if cache.folder is None else str(cache.folder),
            "hits": cache.hits,
            "misses": cache.misses,
            "note": "cached generations keep the timing statistics of the run that produced "
            "them; speedup and tokens/s are computed from those",
        },
        "engine": "flyspec" if engines is None else "vllm",
        "vllm_engines": engines,
        "tasks": report.summarize(samples, settings.methods, list(settings.tasks)),
        "loosening": loosening.analyse(samples, settings.methods, list(settings.tasks)),
        "samples": [s.as_dict() for s in samples],
    }
    if report.plot_tradeoff(output / "tradeoff.png", payload):
        payload["plot"] = "tradeoff.png"
    if loosening.plot(output / "loosening.png", payload["loosening"]):
        payload["loosening_plot"] = "loosening.png"
    report.write_json(output / "eval.json", payload)
    (output / "eval.md").write_text(report.render_markdown(payload), encoding="utf-8")
    return payload


def _decoding_summary(base) -> str:
    sampling = base.sampling
    how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    return f"{how}, drafter {base.drafter}, K={base.k}, entropy {base.fly.entropy}" + (
        f", extra stop strings {list(base.stop)}" if base.stop else ""
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
