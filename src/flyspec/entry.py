"""The ``flyspec`` command's entry point: light, so that the process can start itself again
with huge pages (:mod:`flyspec.support.huge_pages`) before torch and llama.cpp are loaded,
then :func:`flyspec.cli.main`."""

from __future__ import annotations

import sys


def main() -> int:
    from flyspec.support.huge_pages import restart_with_huge_pages

    restart_with_huge_pages(sys.argv[1:])
    from flyspec.cli import main as command

    return command()
