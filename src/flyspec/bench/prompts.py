"""Benchmark prompts, built the way ``flyspec eval`` builds them.

HumanEval and GSM8K prompts come from :mod:`flyspec.evaluation.tasks` (the task's ``prompt``
method is the one place where a problem becomes a prompt), so that speed and accuracy are
measured on the same inputs: HumanEval with chat asks the model to complete the function and
opens its reply with the problem's own code, so the model writes the body; GSM8K asks for
step-by-step reasoning ending in "The answer is N". MT-Bench (not an eval task) uses the first
turn. A prompts file gives raw text, sent as a one-turn chat or raw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flyspec.errors import FlyspecError

DATASET_NAMES = ("humaneval", "humaneval-edit", "gsm8k", "mtbench")


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: chat ``messages`` (plus ``reply_prefix``, text that opens the assistant's
    reply) or a ``raw`` text; and the text its answer is expected to largely repeat
    (``prediction``, Predicted Outputs; empty for none)."""

    id: str
    messages: tuple[dict, ...] = ()
    reply_prefix: str = ""
    raw: str = ""
    prediction: str = ""

    @classmethod
    def from_text(cls, id: str, text: str, *, chat: bool) -> BenchPrompt:
        if chat:
            return cls(id=id, messages=({"role": "user", "content": text},))
        return cls(id=id, raw=text)

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "messages": list(self.messages),
            "reply_prefix": self.reply_prefix,
            "raw": self.raw,
            "prediction": self.prediction,
        }


def build_prompt(item: object, *, chat: bool) -> BenchPrompt:
    """The prompt for one dataset item: a HumanEval problem, a HumanEval edit or a GSM8K
    question (through the eval task's own prompt), or an MT-Bench question (its first turn)."""
    from flyspec.evaluation.edits import EditProblem
    from flyspec.support.datasets import Gsm8kQuestion, HumanEvalProblem, MtBenchQuestion

    tasks = {HumanEvalProblem: "humaneval", EditProblem: "humaneval-edit", Gsm8kQuestion: "gsm8k"}
    if type(item) in tasks:
        from flyspec.evaluation.tasks import make_task

        task = make_task(tasks[type(item)])
        prompt = task.prompt(item, chat=chat)
        return BenchPrompt(
            id=task.problem_id(item),
            messages=tuple(prompt.messages),
            reply_prefix=prompt.reply_prefix,
            raw=prompt.raw,
            prediction=prompt.prediction,
        )
    if isinstance(item, MtBenchQuestion):
        return BenchPrompt.from_text(f"mtbench/{item.question_id}", item.turns[0], chat=chat)
    raise FlyspecError(f"no prompt format for a {type(item).__name__}")


def dataset_prompts(name: str, *, limit: int | None, chat: bool) -> list[BenchPrompt]:
    """The first ``limit`` prompts (all when None) of a packaged dataset."""
    from flyspec.support import datasets

    loaders = {
        "humaneval": datasets.load_humaneval,
        "humaneval-edit": datasets.load_humaneval,
        "gsm8k": datasets.load_gsm8k,
        "mtbench": datasets.load_mtbench,
    }
    if name not in loaders:
        raise FlyspecError(f"unknown dataset {name!r}; choose from {', '.join(DATASET_NAMES)}")
    items = loaders[name]()
    if limit is not None:
        items = items[:limit]
    if name == "humaneval-edit":
        from flyspec.evaluation.edits import build_edit_problems

        items = build_edit_problems(items)
    return [build_prompt(item, chat=chat) for item in items]


def read_prompts_file(path: str | Path, *, limit: int | None, chat: bool) -> list[BenchPrompt]:
    """Prompts from a JSONL file: one object per line with ``prompt`` (and optionally ``id``
    and ``chat``, which overrides the command's ``--chat/--no-chat``)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise FlyspecError(f"cannot read the prompts file {path}: {error.strerror}") from None
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise FlyspecError(f"{path}:{number}: not JSON ({error.msg})") from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise FlyspecError(f'{path}:{number}: expected an object with a non-empty "prompt"')
        prompt_id = str(row.get("id", f"{path.stem}/{len(prompts)}"))
        prompts.append(BenchPrompt.from_text(prompt_id, text, chat=bool(row.get("chat", chat))))
    if not prompts:
        raise FlyspecError(f"the prompts file {path} holds no prompts")
    return prompts[:limit] if limit is not None else prompts


def encode_prompt(tokenizer, prompt: BenchPrompt) -> list[int]:
    """Token ids of a prompt (through the chat template for messages), as
    :meth:`flyspec.engine.Engine.encode` makes them."""
    if not prompt.messages:
        return list(tokenizer.encode(prompt.raw, add_special_tokens=True))
    if not getattr(tokenizer, "chat_template", None):
        raise FlyspecError("this tokenizer has no chat template; use --no-chat")
    text = tokenizer.apply_chat_template(
        list(prompt.messages), tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text + prompt.reply_prefix, add_special_tokens=False))


def encode_prompts(tokenizer, prompts: Sequence[BenchPrompt]) -> list[list[int]]:
    return [encode_prompt(tokenizer, prompt) for prompt in prompts]


def encode_prediction(tokenizer, prompt: BenchPrompt) -> list[int] | None:
    """Token ids of a prompt's prediction, as answer text is tokenized (None without one)."""
    from flyspec.engine import prediction_token_ids

    return prediction_token_ids(tokenizer, prompt.prediction) if prompt.prediction else None
