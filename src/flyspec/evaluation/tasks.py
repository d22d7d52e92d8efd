"""The evaluation tasks: prompt building, answer extraction and scoring.

* HumanEval pass@1: the model continues the problem's function inside a ```python block; the
  code is extracted from whatever came back (a fenced block, a full definition repeating the
  signature, or a bare body), cleaned of top-level test code, and run in the sandbox; the
  problem's ``test`` runs in the sandbox's trusted supervisor, which calls the function in the
  program's process with plain values (:class:`flyspec.evaluation.sandbox.Check`).
* GSM8K accuracy: the model reasons step by step and ends with "The answer is N"; the final
  number (after the last answer marker, else the last number in the text) is compared with the
  ``#### N`` reference, numerically (commas, ``$``, units and trailing zeros do not matter).

Each task has a ``version`` string that enters the generation cache key: change it whenever the
prompt or the early-stop rule changes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Protocol

from flyspec.errors import FlyspecError
from flyspec.evaluation.code import (
    extract_humaneval_code,
    fenced_code,
    run_humaneval_tests,
    sanitize_code,
)
from flyspec.evaluation.edits import EDIT_REQUEST, REPLY_PREFIX, EditProblem
from flyspec.support.datasets import Gsm8kQuestion, HumanEvalProblem

TASK_NAMES: tuple[str, ...] = ("humaneval", "humaneval-edit", "gsm8k")


@dataclass(frozen=True)
class Outcome:
    """A scored generation: ``correct``, a short ``label`` for tables (e.g. ``passed``,
    ``failed``, ``timeout``, ``correct (18)``, ``wrong (17)``, ``no answer``) and a ``detail``."""

    correct: bool
    label: str
    detail: str = ""


@dataclass(frozen=True)
class Prompt:
    """The text sent to the model: chat messages (plus text that opens the assistant's reply)
    or a raw prompt; and the text the answer is expected to largely repeat (``prediction``,
    for Predicted Outputs; empty for none)."""

    messages: tuple[dict, ...] = ()
    reply_prefix: str = ""
    raw: str = ""
    prediction: str = ""

    def token_ids(self, tokenizer) -> list[int]:
        if self.messages:
            text = tokenizer.apply_chat_template(
                list(self.messages), tokenize=False, add_generation_prompt=True
            )
            return list(tokenizer.encode(text + self.reply_prefix, add_special_tokens=False))
        return list(tokenizer.encode(self.raw, add_special_tokens=True))

    def prediction_ids(self, tokenizer) -> list[int] | None:
        """Token ids of the prediction, as answer text is tokenized; None without one."""
        from flyspec.engine import prediction_token_ids

        return prediction_token_ids(tokenizer, self.prediction) if self.prediction else None


class Task(Protocol):
    name: str
    version: str
    default_limit: int
    default_max_new_tokens: int

    def problem_id(self, problem) -> str: ...

    def prompt(self, problem, *, chat: bool) -> Prompt: ...

    def stop_strings(self, *, chat: bool) -> tuple[str, ...]: ...

    def is_complete(self, text: str) -> bool: ...

    def score(self, problem, text: str, *, chat: bool) -> Outcome: ...


# --------------------------------------------------------------------------------- HumanEval

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the completed code in one ```python "
    "block, without tests or usage examples.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class HumanEvalTask:
    """HumanEval pass@1 with greedy decoding, executed in the sandbox."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    name: str = "humaneval"
    version: str = "humaneval-v1"
    default_limit: int = 40
    default_max_new_tokens: int = 384

    def problem_id(self, problem: HumanEvalProblem) -> str:
        return problem.task_id

    def prompt(self, problem: HumanEvalProblem, *, chat: bool) -> Prompt:
        if not chat:
            return Prompt(raw=problem.prompt)
        # The reply opens with the problem's own code, so the model writes the body only.
        return Prompt(
            messages=(
                {"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=problem.prompt)},
            ),
            reply_prefix="```python\n" + problem.prompt,
        )

    def stop_strings(self, *, chat: bool) -> tuple[str, ...]:
        if chat:
            return ("\n```",)
        return ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert ", "\n```")

    def is_complete(self, text: str) -> bool:
        return False

    def program(self, problem: HumanEvalProblem, text: str) -> str:
        """The whole test program as one file (the completed function, the problem's tests,
        the check call), for reading or running by hand; :meth:`score` keeps them apart."""
        code = extract_humaneval_code(problem.prompt, problem.entry_point, text)
        return f"{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"

    def score(self, problem: HumanEvalProblem, text: str, *, chat: bool) -> Outcome:
        """Run the completed function in the sandbox against the problem's tests
        (:func:`~flyspec.evaluation.code.run_humaneval_tests`)."""
        result = run_humaneval_tests(
            problem,
            extract_humaneval_code(problem.prompt, problem.entry_point, text),
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
        )
        return Outcome(result.passed, result.status, result.detail[-600:])


@dataclass(frozen=True)
class HumanEvalEditTask:
    """HumanEval's problems as edits of their working code (:mod:`flyspec.evaluation.edits`),
    with that code as the prediction; pass@1 of the edited function, in the sandbox."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    name: str = "humaneval-edit"
    version: str = "humaneval-edit-v1"
    default_limit: int = 40
    default_max_new_tokens: int = 512

    def problem_id(self, edit: EditProblem) -> str:
        return edit.task_id

    def prompt(self, edit: EditProblem, *, chat: bool) -> Prompt:
        if not chat:
            raise FlyspecError(f"the {self.name} task asks for an edit in a chat: drop --no-chat")
        request = EDIT_REQUEST.format(instruction=edit.instruction, code=edit.code)
        return Prompt(
            messages=({"role": "user", "content": request},),
            reply_prefix=REPLY_PREFIX,
            prediction=edit.code,
        )

    def stop_strings(self, *, chat: bool) -> tuple[str, ...]:
        return ("\n```",)

    def is_complete(self, text: str) -> bool:
        return False

    def program(self, edit: EditProblem, text: str) -> str:
        """The edited code with the problem's tests and the check call, as one file."""
        problem = edit.problem
        code = sanitize_code(fenced_code(text, problem.entry_point))
        return f"{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"

    def score(self, edit: EditProblem, text: str, *, chat: bool) -> Outcome:
        """HumanEval's tests on the edited function (the reply's code), in the sandbox."""
        code = fenced_code(text, edit.problem.entry_point)
        result = run_humaneval_tests(
            edit.problem, code, timeout_s=self.timeout_s, memory_mb=self.memory_mb
        )
        return Outcome(result.passed, result.status, result.detail[-600:])


# ------------------------------------------------------------------------------------ GSM8K

GSM8K_INSTRUCTION = (
    "Solve the following math problem step by step. End your reply with a last line of the "
    'form "The answer is N." where N is the final number only.\n\n{question}'
)
_MARKER = re.compile(
    r"the\s+(?:final\s+)?answer\s+is|final\s+answer\s*[:=]|answer\s*[:=]|####|\\boxed\s*\{",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"(?<![\w.])(-?)\$?\s?(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)")
_COMPLETE = re.compile(
    r"(?:the\s+(?:final\s+)?answer\s+is|####)[^\n]*\d[^\n]*\n|\\boxed\s*\{[^}]*\d[^}]*\}",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Gsm8kTask:
    """GSM8K test accuracy: exact match of the final number."""

    name: str = "gsm8k"
    version: str = "gsm8k-v1"
    default_limit: int = 40
    default_max_new_tokens: int = 384

    def problem_id(self, problem: Gsm8kQuestion) -> str:
        return f"gsm8k/{problem.index}"

    def prompt(self, problem: Gsm8kQuestion, *, chat: bool) -> Prompt:
        if not chat:
            return Prompt(raw=f"Question: {problem.question}\nAnswer: Let's think step by step.")
        content = GSM8K_INSTRUCTION.format(question=problem.question)
        return Prompt(messages=({"role": "user", "content": content},))

    def stop_strings(self, *, chat: bool) -> tuple[str, ...]:
        return () if chat else ("\nQuestion:", "\n\n\n")

    def is_complete(self, text: str) -> bool:
        """The reply has stated its final answer: a line with an answer marker and a number
        has ended, or a ``\\boxed{}`` with a number has closed. Generation stops there."""
        return _COMPLETE.search(text) is not None

    def score(self, problem: Gsm8kQuestion, text: str, *, chat: bool) -> Outcome:
        predicted = extract_gsm8k_answer(text)
        if predicted is None:
            return Outcome(False, "no answer", text[-200:])
        correct = predicted == normalize_number(problem.answer)
        return Outcome(correct, f"{'correct' if correct else 'wrong'} ({predicted})")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number: no commas, ``$`` or spaces, no trailing zeros after the
    decimal point, ``-0`` as ``0`` (``"1,234.50"`` -> ``"1234.5"``); None if not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").replace("\u2212", "-")
    cleaned = cleaned.rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _numbers(text: str) -> list[str]:
    return [sign + digits for sign, digits in _NUMBER.findall(text)]


def extract_gsm8k_answer(text: str) -> str | None:
    """The final numeric answer in a reply, normalised (:func:`normalize_number`).

    The first number after the last answer marker ("The answer is", "Final answer:",
    "Answer:", "####", ``\\boxed{``) that is followed by one; else the last number in the text.
    """
    text = text.replace("\u2212", "-")
    for marker in reversed(list(_MARKER.finditer(text))):
        after = text[marker.end() : marker.end() + 120].lstrip()
        after = after.split("\n\n", 1)[0].split("\n", 1)[0] if after else after
        found = _numbers(after)
        if found:
            return normalize_number(found[0])
    found = _numbers(text)
    return normalize_number(found[-1]) if found else None


def make_task(name: str, *, timeout_s: float = 10.0, memory_mb: int = 1024) -> Task:
    if name == "humaneval":
        return HumanEvalTask(timeout_s=timeout_s, memory_mb=memory_mb)
    if name == "humaneval-edit":
        return HumanEvalEditTask(timeout_s=timeout_s, memory_mb=memory_mb)
    if name == "gsm8k":
        return Gsm8kTask()
    raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}")


def load_problems(name: str, limit: int | None) -> Sequence:
    """The first ``limit`` problems of a task's dataset (installing it when needed)."""
    from flyspec.support.datasets import load_gsm8k, load_humaneval

    if name == "humaneval-edit":
        from flyspec.evaluation.edits import build_edit_problems

        chosen = load_humaneval() if limit is None else load_humaneval()[:limit]
        return build_edit_problems(chosen)
    problems = load_humaneval() if name == "humaneval" else load_gsm8k()
    return problems if limit is None else problems[:limit]
