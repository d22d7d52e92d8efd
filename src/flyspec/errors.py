"""The one exception type that carries a user mistake or an environment problem, and how
another library's error is told in one of its messages."""


class FlyspecError(Exception):
    """An error whose message is meant for the user: the CLI prints it as one line, no traceback."""


def error_line(error: BaseException, *, limit: int | None = None) -> str:
    """``Type: first line of its message`` (the type alone where the message is empty), the
    line cut at ``limit`` characters: another library's error, often many lines, in one."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0][:limit]}"
