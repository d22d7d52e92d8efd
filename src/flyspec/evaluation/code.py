"""Python code in a model's reply: found (a fenced block, a full definition, a bare body),
cleaned of top-level test code, and run against HumanEval's tests in the sandbox."""

from __future__ import annotations

import ast
import re
import warnings

from flyspec.support.datasets import HumanEvalProblem

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)
_KEPT_NODES = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


def extract_humaneval_code(prompt: str, entry_point: str, completion: str) -> str:
    """Complete source code for a HumanEval problem from a model's completion.

    The completion may be a bare function body continuing ``prompt`` (indented or not), a full
    definition of ``entry_point`` repeating the signature, or either of those inside a fenced
    ```python block with text around it. Top-level statements other than imports,
    definitions and assignments (prints, asserts, ``if __name__ == "__main__":`` blocks) are
    dropped, and a completion cut off by the token limit is shortened to its longest prefix
    that parses.
    """
    code = fenced_code(completion, entry_point)
    definition = re.compile(rf"^(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    if definition.search(code):
        # Keep the prompt first: its imports and helper functions may not be repeated.
        source = prompt.rstrip() + "\n\n\n" + code.strip("\n") + "\n"
    else:
        source = prompt + _as_body(code)
    return sanitize_code(source)


def fenced_code(text: str, entry_point: str) -> str:
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if not blocks:
        return text
    python = [body for lang, body in blocks if lang in ("python", "py", "python3", "")]
    candidates = python or [body for _, body in blocks]
    for body in candidates:
        if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", body):
            return body
    # Text before the first fence may itself be the body (the reply was opened inside a block).
    before = text[: text.find("```")]
    if before.strip():
        return before
    return candidates[0]


def _as_body(code: str) -> str:
    lines = code.split("\n")
    first = next((line for line in lines if line.strip()), "")
    if first and not first[0].isspace():
        lines = ["    " + line if line.strip() else line for line in lines]
    return "\n".join(lines)


def sanitize_code(source: str) -> str:
    """``source`` cut to its longest prefix that parses, with only its imports, definitions
    and assignments kept (no prints, asserts or ``__main__`` blocks)."""
    tree = _parse_longest_prefix(source)
    if tree is None:
        return source  # a syntax error the sandbox will report
    lines = source.split("\n")
    kept: list[str] = []
    for node in tree.body:
        if not isinstance(node, _KEPT_NODES):
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        kept.extend(lines[start - 1 : node.end_lineno])
        kept.append("")
    return "\n".join(kept)


def _parse_longest_prefix(source: str) -> ast.Module | None:
    lines = source.split("\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. SyntaxWarning on odd literals in broken code
        for end in range(len(lines), 0, -1):
            try:
                return ast.parse("\n".join(lines[:end]))
            except (SyntaxError, ValueError):
                continue
    return None


def run_humaneval_tests(
    problem: HumanEvalProblem, code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024
):
    """HumanEval's tests of ``problem`` on the functions of ``code``, in the sandbox: its
    :class:`~flyspec.evaluation.sandbox.SandboxResult`. The tests run in the sandbox's trusted
    supervisor, which calls the function in the program's process with plain values: the
    generated code cannot reach the tests, so it cannot fake a pass."""
    from flyspec.evaluation.sandbox import Check, run_sandboxed

    check = Check(
        tests=problem.test,
        entry_point=problem.entry_point,
        prelude=sanitize_code(problem.prompt),  # helpers some tests call (e.g. HumanEval/32)
    )
    return run_sandboxed(sanitize_code(code), timeout_s=timeout_s, memory_mb=memory_mb, check=check)
