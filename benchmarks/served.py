"""``flyspec serve`` as a child process, for the benchmarks that measure it over HTTP: on a
free port, waited for until ``/health`` answers, and always stopped."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from flyspec.support.child_server import running


@contextmanager
def serving(arguments: Sequence[str], *, start_seconds: float = 600) -> Iterator[str]:
    """``flyspec serve ARGUMENTS`` (this Python's flyspec) on a free port: its URL once it
    answers ``/health``; FlyspecError with its last line where it exits first or does not
    answer within ``start_seconds``."""

    def command(port: int) -> list[str]:
        serve = [sys.executable, "-m", "flyspec.cli", "serve", "--port", str(port)]
        return [*serve, "--log-level", "warning", *arguments]

    with running("flyspec serve", command, start_seconds=start_seconds) as url:
        yield url
