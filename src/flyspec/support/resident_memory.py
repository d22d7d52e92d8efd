"""Resident memory (RSS) of this process and of the processes it started, read from Linux's
``/proc``: what a command, a benchmark method or an engine needed, as a figure beside its speed.

``tracemalloc`` does not see torch's allocations, and weights mapped from their files count only
once their pages are touched, so RSS is the measure. Elsewhere than on Linux every figure is 0.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
from pathlib import Path

SAMPLE_SECONDS = 0.05
PROCESS_SCAN_SECONDS = 1.0  # how often the watch looks for new child processes


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` now (0 where it cannot be read)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, and by them, and so on."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # The command name (2nd field) is in parentheses and may hold spaces.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def tree_rss_bytes(pid: int | None = None) -> int:
    """The resident memory of ``pid`` (this process by default) and all its descendants, such
    as a vLLM engine's core and worker processes."""
    pid = os.getpid() if pid is None else pid
    return sum(rss_bytes(p) for p in [pid, *descendants(pid)])


def forget_touched(pid: int | None = None) -> None:
    """Clear the "referenced" mark of every page of ``pid`` (this process by default) and its
    descendants, so that :func:`touched_bytes` counts from now on (Linux's ``clear_refs``;
    nothing where it cannot be written)."""
    pid = os.getpid() if pid is None else pid
    for process in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            Path(f"/proc/{process}/clear_refs").write_text("1")


def touched_bytes(pid: int | None = None) -> int:
    """The resident memory of ``pid`` and its descendants read or written since
    :func:`forget_touched` (``Referenced`` in ``smaps_rollup``): what one piece of work used,
    in a process that holds more (0 where it cannot be read)."""
    pid = os.getpid() if pid is None else pid
    total = 0
    for process in [pid, *descendants(pid)]:
        try:
            rollup = Path(f"/proc/{process}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            if line.startswith("Referenced:"):
                total += int(line.split()[1]) * 1024
    return total


def peak_rss_bytes() -> int:
    """This process's resident high-water mark since it started (``VmHWM``: getrusage's
    figure is no use here, since Linux carries it over from the parent across fork and exec,
    so a command started by a big process would report the parent's peak)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The highest resident memory of this process and its descendants while a block runs,
    sampled every :data:`SAMPLE_SECONDS` by a thread (``peak_bytes`` once the block is done)::

        with PeakRss() as watch:
            generate(...)
        watch.peak_bytes
    """

    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="flyspec-rss")

    def _watch(self) -> None:
        me = os.getpid()
        pids, scanned = [me], 0.0
        while True:
            if scanned <= 0:
                pids, scanned = [me, *descendants(me)], PROCESS_SCAN_SECONDS
            self.peak_bytes = max(self.peak_bytes, sum(rss_bytes(pid) for pid in pids))
            if self._stop.wait(self.interval):
                return
            scanned -= self.interval

    def __enter__(self) -> PeakRss:
        self.peak_bytes = tree_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes())


def gib(n_bytes: float) -> float:
    """Bytes in GiB, rounded for a report."""
    return round(n_bytes / 2**30, 2)
