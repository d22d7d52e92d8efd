"""Status lines for the person running a command."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """A progress or status line on stderr (stdout carries the command's result)."""
    print(message, file=sys.stderr, flush=True)
