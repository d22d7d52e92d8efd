"""The HumanEval edit task: edit code that already works, keeping what it does.

The code to edit is a problem's canonical solution (its prompt and body), and the request's
prediction (Predicted Outputs) is that code as it stands. Each problem gets one kind of edit,
in turn, where it applies:

* ``types``: add type hints and a docstring (the code comes without either);
* ``rename``: give the local variables descriptive names;
* ``restructure``: a for loop into a comprehension, or a comprehension into a loop;
* ``bugfix``: fix a bug the task injected (an operator, a constant or a boolean changed in the
  body; the first such change that makes the problem's tests fail, checked in the sandbox).

The reply opens with a ```python fence, so the model writes the edited code at once; scoring
runs HumanEval's tests on the edited function in the sandbox, as :mod:`flyspec.evaluation.tasks`
does for completions. Which edit a problem gets, its instruction and the injected bug are
fixed by the task's ``version``.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass

from flyspec.errors import FlyspecError
from flyspec.evaluation.code import run_humaneval_tests
from flyspec.support.datasets import HumanEvalProblem

EDIT_KINDS: tuple[str, ...] = ("types", "rename", "restructure", "bugfix")

INSTRUCTIONS = {
    "types": (
        "Add type hints to the parameters and the return value of every function below, and a "
        "docstring that says what each function does. Change nothing else."
    ),
    "rename": (
        "Rename the local variables of the code below to descriptive names. Keep the names of "
        "the functions and of their parameters, and change nothing else."
    ),
    "restructure-loop": (
        "Rewrite the for loop(s) below as comprehensions or generator expressions where "
        "possible, keeping what the code does. Change nothing else."
    ),
    "restructure-comprehension": (
        "Rewrite the comprehensions and generator expressions below as explicit for loops, "
        "keeping what the code does. Change nothing else."
    ),
    "bugfix": (
        "The code below has a bug: it does not do what its docstring says. Fix the bug with "
        "the smallest change. Change nothing else."
    ),
}
EDIT_REQUEST = (
    "{instruction}\n\n```python\n{code}```\n\n"
    "Reply with the whole edited code in one ```python block, without tests or usage examples."
)
REPLY_PREFIX = "```python\n"

_SWAPS = {
    "<": "<=",
    "<=": "<",
    ">": ">=",
    ">=": ">",
    "==": "!=",
    "!=": "==",
    "+": "-",
    "-": "+",
    "and": "or",
    "or": "and",
    "True": "False",
    "False": "True",
    "0": "1",
    "1": "0",
}
MAX_BUG_TRIES = 8
"""Changes tried, in order of their place in the body, before a problem is given another
kind of edit."""


@dataclass(frozen=True)
class EditProblem:
    """One edit request: the HumanEval ``problem``, the ``kind`` of edit, its
    ``instruction`` and the ``code`` to edit (also the request's prediction)."""

    problem: HumanEvalProblem
    kind: str
    instruction: str
    code: str

    @property
    def task_id(self) -> str:
        return f"{self.problem.task_id}/{self.kind}"


def build_edit_problems(
    problems: Sequence[HumanEvalProblem], *, first: int = 0, check_timeout_s: float = 5.0
) -> list[EditProblem]:
    """The edit of each problem: kind number ``(first + i) % 4`` for the i-th, or the next kind
    that applies to its code (``first``: the problems' index in HumanEval)."""
    edits = []
    for offset, problem in enumerate(problems):
        start = (first + offset) % len(EDIT_KINDS)
        kinds = EDIT_KINDS[start:] + EDIT_KINDS[:start]
        for kind in kinds:
            edit = make_edit(problem, kind, check_timeout_s=check_timeout_s)
            if edit is not None:
                edits.append(edit)
                break
        else:
            raise FlyspecError(f"no edit applies to {problem.task_id}")
    return edits


def make_edit(
    problem: HumanEvalProblem, kind: str, *, check_timeout_s: float = 5.0
) -> EditProblem | None:
    """The ``kind`` edit of ``problem``, or None where it does not apply to its code."""
    source = problem.prompt + problem.canonical_solution
    if kind == "types":
        return EditProblem(problem, kind, INSTRUCTIONS[kind], without_hints_and_docstrings(source))
    if kind == "rename":
        if not local_names(source, problem.entry_point):
            return None
        return EditProblem(problem, kind, INSTRUCTIONS[kind], source)
    if kind == "restructure":
        tree = ast.parse(source)
        if any(isinstance(node, (ast.For, ast.AsyncFor)) for node in ast.walk(tree)):
            return EditProblem(problem, kind, INSTRUCTIONS["restructure-loop"], source)
        comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        if any(isinstance(node, comprehensions) for node in ast.walk(tree)):
            return EditProblem(problem, kind, INSTRUCTIONS["restructure-comprehension"], source)
        return None
    if kind == "bugfix":
        buggy = injected_bug(problem, timeout_s=check_timeout_s)
        return None if buggy is None else EditProblem(problem, kind, INSTRUCTIONS[kind], buggy)
    raise ValueError(f"unknown edit kind {kind!r}; choose from {', '.join(EDIT_KINDS)}")


def without_hints_and_docstrings(source: str) -> str:
    """``source`` with every function's annotations and docstring taken out."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        node.returns = None
        arguments = node.args
        for argument in (
            *arguments.posonlyargs,
            *arguments.args,
            *arguments.kwonlyargs,
            arguments.vararg,
            arguments.kwarg,
        ):
            if argument is not None:
                argument.annotation = None
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def local_names(source: str, entry_point: str) -> set[str]:
    """Names ``entry_point`` assigns in its body (loop targets included), its parameters
    left out."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            parameters = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            stored = {
                name.id
                for statement in node.body
                for name in ast.walk(statement)
                if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store)
            }
            return stored - parameters
    return set()


def bug_candidates(problem: HumanEvalProblem) -> list[str]:
    """Sources of the problem with one token of its body changed (an operator, a boolean, a
    0 or 1), in the order of their place; each parses."""
    body = problem.canonical_solution
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(body).readline))
    except (tokenize.TokenError, IndentationError):
        return []
    lines = body.splitlines(keepends=True)
    candidates = []
    for token in tokens:
        if token.string not in _SWAPS or token.type not in (
            tokenize.OP,
            tokenize.NAME,
            tokenize.NUMBER,
        ):
            continue
        (row, column), (end_row, end_column) = token.start, token.end
        if row != end_row:
            continue
        line = lines[row - 1]
        changed = line[:column] + _SWAPS[token.string] + line[end_column:]
        mutated = "".join(lines[: row - 1] + [changed] + lines[row:])
        source = problem.prompt + mutated
        try:
            ast.parse(source)
        except SyntaxError:
            continue
        candidates.append(source)
    return candidates


def injected_bug(problem: HumanEvalProblem, *, timeout_s: float = 5.0) -> str | None:
    """The first of :func:`bug_candidates` (at most :data:`MAX_BUG_TRIES`) whose function
    fails the problem's tests in the sandbox, or None."""
    for source in bug_candidates(problem)[:MAX_BUG_TRIES]:
        if not run_humaneval_tests(problem, source, timeout_s=timeout_s).passed:
            return source
    return None
