"""The HumanEval edit task: which edit each problem gets, the injected bug, the prompt with
its prediction, and scoring of known-good and known-bad edits in the sandbox."""

import ast
import os

import pytest

from flyspec.errors import FlyspecError
from flyspec.evaluation.edits import (
    EDIT_KINDS,
    bug_candidates,
    build_edit_problems,
    local_names,
    make_edit,
    without_hints_and_docstrings,
)
from flyspec.evaluation.tasks import make_task
from flyspec.support.datasets import HUMANEVAL, HumanEvalProblem, installed_dataset_file

PROMPT = '''from typing import List


def count_below(numbers: List[int], limit: int) -> int:
    """ How many of numbers are below limit.
    >>> count_below([1, 5, 2], 3)
    2
    """
'''
SOLUTION = """    count = 0
    for number in numbers:
        if number < limit:
            count += 1
    return count
"""
TESTS = """
def check(candidate):
    assert candidate([1, 5, 2], 3) == 2
    assert candidate([], 3) == 0
    assert candidate([3, 3], 3) == 0
    assert candidate([0, 9, -1], 1) == 2
"""
PROBLEM = HumanEvalProblem("Test/0", PROMPT, "count_below", TESTS, SOLUTION)
WORKING = PROMPT + SOLUTION


def test_types_edits_start_from_code_without_hints_or_docstrings():
    code = without_hints_and_docstrings(WORKING)
    function = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef))
    assert function.returns is None and all(a.annotation is None for a in function.args.args)
    assert ast.get_docstring(function) is None
    assert "for number in numbers:" in code


def test_rename_needs_local_names_and_restructure_a_loop_or_comprehension():
    assert local_names(WORKING, "count_below") == {"count", "number"}
    one_liner = HumanEvalProblem("Test/1", "def f(x):\n", "f", TESTS, "    return x + 1\n")
    assert make_edit(one_liner, "rename") is None
    assert make_edit(one_liner, "restructure") is None
    edit = make_edit(PROBLEM, "restructure")
    assert "comprehensions" in edit.instruction and edit.code == WORKING


def test_the_injected_bug_is_the_first_change_that_fails_the_tests():
    """``count = 0`` -> ``count = 1`` is the first change of the body, and the tests catch it."""
    candidates = bug_candidates(PROBLEM)
    assert candidates[0] == WORKING.replace("count = 0", "count = 1")
    edit = make_edit(PROBLEM, "bugfix")
    assert edit.code == candidates[0] and edit.task_id == "Test/0/bugfix"
    task = make_task("humaneval-edit")
    assert not task.score(edit, edit.code, chat=True).correct  # the bug, left in, fails
    assert task.score(edit, WORKING, chat=True).correct  # the fix passes


def test_scoring_runs_the_tests_on_the_edited_function():
    task = make_task("humaneval-edit")
    edit = make_edit(PROBLEM, "rename")
    renamed = WORKING.replace("count", "total").replace("def total_below", "def count_below")
    assert task.score(edit, renamed + "\n```\nDone.", chat=True).correct
    wrong = renamed.replace("if number < limit", "if number <= limit")
    outcome = task.score(edit, wrong, chat=True)
    assert not outcome.correct and outcome.label == "failed"


def test_the_prompt_opens_the_reply_in_code_and_predicts_the_code():
    task = make_task("humaneval-edit")
    edit = make_edit(PROBLEM, "rename")
    prompt = task.prompt(edit, chat=True)
    assert prompt.prediction == WORKING and prompt.reply_prefix == "```python\n"
    assert WORKING in prompt.messages[0]["content"]
    assert task.stop_strings(chat=True) == ("\n```",)
    with pytest.raises(FlyspecError, match="drop --no-chat"):
        task.prompt(edit, chat=False)


def humaneval_problems(count: int) -> list[HumanEvalProblem]:
    if not installed_dataset_file(HUMANEVAL).is_file():
        if os.environ.get("CI"):
            pytest.fail("HumanEval is not installed (flyspec datasets pull)")
        pytest.skip("HumanEval is not installed (flyspec datasets pull)")
    from flyspec.support.datasets import load_humaneval

    return load_humaneval()[:count]


def test_the_first_problems_get_each_kind_and_their_canonical_code_passes():
    problems = humaneval_problems(12)
    edits = build_edit_problems(problems)
    assert {edit.kind for edit in edits} == set(EDIT_KINDS)
    assert edits[0].kind == "types" and edits[3].kind == "bugfix"
    task = make_task("humaneval-edit")
    for edit in edits:
        problem = edit.problem
        assert task.score(edit, problem.prompt + problem.canonical_solution, chat=True).correct
        if edit.kind == "bugfix":
            assert not task.score(edit, edit.code, chat=True).correct
