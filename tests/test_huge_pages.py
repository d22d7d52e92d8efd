"""When the ``flyspec`` command starts itself again with glibc's huge-page tunable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec.support.huge_pages import (
    SWITCH,
    huge_pages_environment,
    started_environment,
)

MADVISE = "always [madvise] never\n"
GLIBC = ("glibc", "2.36")


def test_glibc_is_told_to_advise_huge_pages_where_the_kernel_waits_to_be_asked():
    environment = huge_pages_environment({"HOME": "/root"}, thp_mode=MADVISE, libc=GLIBC)
    assert environment["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert environment["HOME"] == "/root"
    assert started_environment(environment) == {"HOME": "/root"}  # what llama-server gets


def test_the_user_s_own_tunables_are_kept():
    given = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    environment = huge_pages_environment(given, thp_mode=MADVISE, libc=GLIBC)
    assert environment["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert started_environment(environment) == given
    assert started_environment(given) == given  # not restarted: as it is


@pytest.mark.parametrize(
    "environ, thp_mode, libc",
    [
        ({SWITCH: "0"}, MADVISE, GLIBC),  # turned off
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, MADVISE, GLIBC),  # the user's choice
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, MADVISE, GLIBC),  # already restarted
        ({}, "[always] madvise never\n", GLIBC),  # huge pages without asking
        ({}, "always madvise [never]\n", GLIBC),  # none even when asked
        ({}, None, GLIBC),  # no such kernel setting
        ({}, MADVISE, ("glibc", "2.31")),  # no such tunable
        ({}, MADVISE, ("", "")),  # another C library
    ],
)
def test_no_restart_where_it_gains_nothing(environ, thp_mode, libc):
    assert huge_pages_environment(environ, thp_mode=thp_mode, libc=libc) is None


def test_the_command_runs_after_starting_again():
    """The entry point (``python -m flyspec``, as the console script) starts ``python -m
    flyspec.cli`` again with the tunable where the machine has huge pages to give, and the
    command's output is the same either way."""
    source = str(Path(__file__).resolve().parents[1] / "src")
    environment = {**os.environ, "PYTHONPATH": source}
    environment.pop("GLIBC_TUNABLES", None)
    runs = {
        switch: subprocess.run(
            [sys.executable, "-m", "flyspec", "--help"],
            env={**environment, SWITCH: switch},
            capture_output=True,
            text=True,
            timeout=120,
        )
        for switch in ("1", "0")
    }
    assert all(run.returncode == 0 for run in runs.values()), runs
    assert "usage: flyspec" in runs["1"].stdout
    assert runs["1"].stdout == runs["0"].stdout
