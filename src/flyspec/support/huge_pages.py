"""Transparent huge pages for the ``flyspec`` command's own process.

Decoding reads every weight once a token, so the TLB misses of 4 KiB pages cost: llama.cpp's
weights repacked for the CPU, its KV cache and compute buffers are about 1.2 GiB of anonymous
memory for the default target. Where the kernel's transparent huge pages are in ``madvise``
mode (the common default), memory gets huge pages only where a program asks with
``madvise(MADV_HUGEPAGE)``, which neither llama.cpp nor torch does for these buffers. glibc
(2.35 and later) asks for every block it maps when its ``glibc.malloc.hugetlb=1`` tunable is
set, but reads its tunables only when a process starts. So the command, started without it,
starts itself again once with it (:func:`restart_with_huge_pages`): llama.cpp's decoding then
takes about 3% less time a token (docs/benchmarks.md, "Huge pages").
``FLYSPEC_HUGE_PAGES=0`` turns this off. A program that uses flyspec as a library sets
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` itself.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "FLYSPEC_HUGE_PAGES"
"""Set to 0 to keep the process as it started."""
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
BEFORE = "FLYSPEC_GLIBC_TUNABLES_BEFORE"
"""Where the restart keeps ``GLIBC_TUNABLES`` as the command was started (empty: unset)."""


def huge_pages_environment(
    environ: Mapping[str, str], *, thp_mode: str | None, libc: tuple[str, str]
) -> dict[str, str] | None:
    """The environment to start again with, None where that gains nothing: huge pages turned
    off by :data:`SWITCH`, the tunable already set (by the user, or by the restart), the
    kernel's mode not ``madvise`` (``always`` gives them already, ``never`` none), or a C
    library other than glibc 2.35 or later. ``thp_mode``: the kernel's mode file's text
    (None where it has none); ``libc``: :func:`platform.libc_ver`'s answer."""
    if environ.get(SWITCH, "1") == "0" or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return None
    if thp_mode is None or "[madvise]" not in thp_mode:
        return None
    name, version = libc
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):
        return None
    return with_huge_pages(environ)


def with_huge_pages(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with glibc's huge-page tunable after its other tunables, and those kept
    under :data:`BEFORE` for :func:`started_environment`."""
    before = environ.get("GLIBC_TUNABLES", "")
    tunables = [entry for entry in before.split(":") if entry]
    return {**environ, "GLIBC_TUNABLES": ":".join([*tunables, f"{TUNABLE}=1"]), BEFORE: before}


def started_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as the command was started, before its restart with huge pages
    (``environ``: this process's by default): what a program it runs for comparison, such as
    llama-server, gets, so that it runs as its own users run it."""
    environment = dict(os.environ if environ is None else environ)
    if BEFORE in environment:
        before = environment.pop(BEFORE)
        if before:
            environment["GLIBC_TUNABLES"] = before
        else:
            environment.pop("GLIBC_TUNABLES", None)
    return environment


def restart_with_huge_pages(arguments: Sequence[str]) -> None:
    """Replace this process by ``python -m flyspec.cli ARGUMENTS`` with glibc's huge-page
    tunable, where :func:`huge_pages_environment` says it gains; return otherwise."""
    if sys.platform != "linux":
        return
    try:
        thp_mode = THP_MODE.read_text()
    except OSError:
        thp_mode = None
    environment = huge_pages_environment(os.environ, thp_mode=thp_mode, libc=platform.libc_ver())
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "flyspec.cli", *arguments], environment)
