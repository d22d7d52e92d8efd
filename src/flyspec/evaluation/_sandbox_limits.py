"""Run-wide limits of the evaluation sandbox: per-run cgroups, and the host's watchdog.

A run's ``memory_mb`` bounds all its processes together and ``max_processes`` their number. Where
this process can make cgroups (v2 with the memory and pids controllers, in its own cgroup or
beside it; else the v1 ``memory`` and ``pids`` hierarchies), each run gets its own, made with
its limits before the run starts and removed after: the kernel enforces them, an out-of-memory
kill in it ends the whole run, forks past the limit fail. Whatever no cgroup covers, the
:class:`Watch` in the host enforces: every ``WATCH_S`` it walks the run's process tree
(``/proc/<pid>/task/*/children``; the supervisor is a child subreaper, or PID 1 of the run's
namespace, so orphans stay in the tree), sums their proportional memory (PSS) and counts them,
and kills the whole run over budget.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OVERHEAD_PROCESSES = 2  # the sandbox's own: unshare (or the cgroup joiner) and the supervisor
POLL_S = 0.005
WATCH_S = 0.02
CGROUP_PREFIX = "flyspec-sandbox-"


def count_processes(uid: int | None) -> int:
    """Threads that already count against ``uid``'s RLIMIT_NPROC (0 for root, never bound)."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return 0
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        owner = threads = None
        try:
            with open(f"/proc/{entry.name}/status", "rb") as handle:
                for line in handle:
                    if line.startswith(b"Uid:"):
                        owner = int(line.split()[1])
                    elif line.startswith(b"Threads:"):
                        threads = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
        if owner == uid:
            count += threads or 1
    return count


# ------------------------------------------------------------------------- watching a run


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                found += [int(child) for child in handle.read().split()]
    except (OSError, ValueError):
        pass
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
        return fields[0].decode(), int(fields[3])
    except (OSError, ValueError, IndexError):
        return None


def _memory_of(pid: int) -> int:
    """Bytes of memory a process holds: its PSS where readable, else its RSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            for line in handle:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Watch:
    """Waits for a run while enforcing its budgets, then kills whatever is left of it."""

    def __init__(
        self,
        process: subprocess.Popen,
        cgroup: RunCgroup | None,
        memory_mb: int,
        max_processes: int,
        *,
        by_namespace: bool,
    ) -> None:
        self.process = process
        self.cgroup = cgroup
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.by_namespace = by_namespace
        self.watch_memory = cgroup is None or cgroup.memory is None
        self.watch_count = cgroup is None or cgroup.pids is None
        self.timed_out = False
        self.violation: str | None = None  # why the run was killed over its budgets
        self._peak = 0

    def wait(self, timeout_s: float) -> None:
        """Return once the run's first process has ended, or the run was killed for its time
        or its budgets (``timed_out``, ``violation``); every process of the run is dead."""
        deadline = time.monotonic() + timeout_s
        next_watch = 0.0
        timed_out, violation = False, None
        try:
            while True:
                try:
                    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
                    if os.waitid(os.P_PID, self.process.pid, flags) is not None:
                        break
                except ChildProcessError:
                    break
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if now >= next_watch:
                    violation = self._violation()
                    if violation is not None:
                        break
                    next_watch = now + WATCH_S
                time.sleep(POLL_S)
        finally:  # also when the caller is interrupted: nothing of the run may outlive it
            # The first process is not reaped yet, so its process group id still names the run.
            self._kill()
            self.process.wait()
        if violation is None and not timed_out:
            violation = self._violation(final=True)
        self.timed_out, self.violation = timed_out, violation

    def _tree(self) -> list[int]:
        found, pending = [], [self.process.pid]
        while pending:
            pid = pending.pop()
            found.append(pid)
            pending += _children(pid)
        return found

    def _violation(self, *, final: bool = False) -> str | None:
        cgroup = self.cgroup
        if cgroup is not None and cgroup.memory is not None and cgroup.oom_kills() > 0:
            return self._over_memory("the kernel ended a process of the run's cgroup")
        if final or not (self.watch_memory or self.watch_count):
            return None
        pids = self._tree()
        if self.watch_count and len(pids) > self.max_processes + OVERHEAD_PROCESSES:
            return f"the run had more than its {self.max_processes} processes and was killed"
        if self.watch_memory:
            used = sum(_memory_of(pid) for pid in pids)
            self._peak = max(self._peak, used)
            if used > self.memory_mb << 20:
                return self._over_memory(f"the watchdog measured {used / 2**20:.0f} MiB")
        return None

    def _over_memory(self, how: str) -> str:
        return (
            f"killed: the run went over its memory budget of {self.memory_mb} MiB "
            f"(all its processes together; {how})"
        )

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.by_namespace:
            return  # the supervisor was PID 1 of the run's namespace: all of it is gone
        session = self.process.pid

        def alive() -> list[int]:
            pids = [pid for pid in self._tree() if pid != self.process.pid]
            for entry in os.scandir("/proc"):
                if entry.name.isdigit() and int(entry.name) != self.process.pid:
                    state = _stat(int(entry.name))
                    if state is not None and state[1] == session and state[0] != "Z":
                        pids.append(int(entry.name))
            return pids

        kill_until_gone(alive, attempts=50, pause_s=0.002)

    def note(self) -> str:
        """What a failed run's detail should also say about the limits."""
        cgroup = self.cgroup
        if cgroup is not None and cgroup.pids is not None and cgroup.refused_forks() > 0:
            return (
                f"the run reached its limit of {self.max_processes} processes: "
                "further forks were refused"
            )
        return ""

    def peak_mb(self) -> float | None:
        if self.cgroup is not None and self.cgroup.memory is not None:
            return self.cgroup.peak_mb()
        return round(self._peak / 2**20, 1) if self._peak else None


# ----------------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class CgroupPlan:
    """Where a run's cgroups are made: v2 (one folder for both controllers) or v1 (one
    hierarchy per controller; either may be missing)."""

    version: int
    memory: Path | None
    pids: Path | None

    def describe(self) -> str:
        if self.version == 2:
            return f"cgroup v2 memory and pids controllers under {self.memory}"
        parts = [f"{name} under {path}" for name, path in self._controllers()]
        return "cgroup v1 " + " and ".join(parts)

    def short(self) -> str:
        names = [name for name, _ in self._controllers()]
        text = f"cgroup v{self.version} ({', '.join(names)})"
        return text if len(names) == 2 else text + " + watchdog"

    def _controllers(self) -> list[tuple[str, Path]]:
        pairs = (("memory", self.memory), ("pids", self.pids))
        return [(name, path) for name, path in pairs if path is not None]


def _unescape(text: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` for a space) decoded."""
    parts = text.split("\\")
    out = [parts[0]]
    for part in parts[1:]:
        if len(part) >= 3 and part[:3].isdigit():
            out.append(chr(int(part[:3], 8)) + part[3:])
        else:
            out.append("\\" + part)
    return "".join(out)


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, str, Path, set[str]]]:
    """(type, root, mount point, super options) of every cgroup file system mounted."""
    mounts = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = set(tail[2].split(","))
        mounts.append((tail[0], _unescape(fields[3]), Path(_unescape(fields[4])), options))
    return mounts


def _own_cgroups(text: str) -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and not controllers:
            own[""] = path
            continue
        for controller in controllers.split(","):
            if controller and not controller.startswith("name="):
                own[controller] = path
    return own


def _cgroup_folder(point: Path, root: str, path: str) -> Path | None:
    if root != "/":
        if path != root and not path.startswith(root.rstrip("/") + "/"):
            return None
        path = path[len(root) :]
    return point / path.lstrip("/")


def _holds(folder: Path, pid: int) -> bool:
    try:
        return str(pid) in (folder / "cgroup.procs").read_text().split()
    except OSError:
        return False


def _can_make(folder: Path) -> bool:
    """True when a child cgroup can be made (and removed) in ``folder``; removes empty run
    cgroups left by flyspec processes that no longer exist."""
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            owner = entry.name.removeprefix(CGROUP_PREFIX).split("-", 1)[0]
            ours = entry.name.startswith(CGROUP_PREFIX) and owner.isdigit()
            if ours and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    entry.rmdir()
    probe = folder / f"{CGROUP_PREFIX}{os.getpid()}-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def cgroup_plan(
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    mountinfo: Path = Path("/proc/self/mountinfo"),
) -> CgroupPlan | None:
    """Where this process can make per-run cgroups: v2 with the memory and pids controllers
    (in its own cgroup, else as a sibling of it), else v1 memory and/or pids; None if nowhere."""
    try:
        own = _own_cgroups(proc_cgroup.read_text())
        mounts = _cgroup_mounts(mountinfo.read_text())
    except OSError:
        return None
    pid = os.getpid()
    for kind, root, point, _ in mounts:
        if kind != "cgroup2" or "" not in own:
            continue
        folder = _cgroup_folder(point, root, own[""])
        if folder is None or not _holds(folder, pid):
            continue
        for parent in (folder, folder.parent):
            if parent != point and point not in parent.parents:
                continue
            try:
                controllers = set((parent / "cgroup.subtree_control").read_text().split())
            except OSError:
                continue
            if {"memory", "pids"} <= controllers and _can_make(parent):
                return CgroupPlan(2, parent, parent)
    found: dict[str, Path] = {}
    for kind, root, point, options in mounts:
        if kind != "cgroup":
            continue
        for controller in ("memory", "pids"):
            if controller in options and controller in own and controller not in found:
                folder = _cgroup_folder(point, root, own[controller])
                if folder is not None and _holds(folder, pid) and _can_make(folder):
                    found[controller] = folder
    if found:
        return CgroupPlan(1, found.get("memory"), found.get("pids"))
    return None


def _write(path: Path, value: int) -> None:
    path.write_text(f"{value}\n")


def _read_keys(path: Path) -> dict[str, int]:
    """``key value`` lines (memory.events, memory.oom_control, pids.events)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[key] = int(value)
    return values


class RunCgroup:
    """The cgroup(s) of one run, made with its limits before it starts and removed after."""

    def __init__(self, plan: CgroupPlan, memory_mb: int, max_processes: int) -> None:
        self.version = plan.version
        self.memory: Path | None = None
        self.pids: Path | None = None
        self.folders: list[Path] = []
        name = f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        budget = memory_mb << 20
        pids_max = max_processes + OVERHEAD_PROCESSES
        try:
            if plan.version == 2 and plan.memory is not None:
                folder = self._make(plan.memory / name)
                _write(folder / "memory.max", budget)
                with contextlib.suppress(OSError):
                    _write(folder / "memory.swap.max", 0)
                with contextlib.suppress(OSError):
                    _write(folder / "memory.oom.group", 1)
                _write(folder / "pids.max", pids_max)
                self.memory = self.pids = folder
            elif plan.version == 1:
                if plan.memory is not None:
                    folder = self._make(plan.memory / name)
                    _write(folder / "memory.limit_in_bytes", budget)
                    with contextlib.suppress(OSError):
                        _write(folder / "memory.memsw.limit_in_bytes", budget)
                    self.memory = folder
                if plan.pids is not None:
                    folder = self._make(plan.pids / name)
                    _write(folder / "pids.max", pids_max)
                    self.pids = folder
        except OSError:
            self.remove()
            raise

    def _make(self, folder: Path) -> Path:
        folder.mkdir()
        self.folders.append(folder)
        return folder

    def procs_files(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.folders]

    def processes(self) -> set[int]:
        found: set[int] = set()
        for folder in self.folders:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
        return found

    def oom_kills(self) -> int:
        if self.memory is None:
            return 0
        if self.version == 2:
            return _read_keys(self.memory / "memory.events").get("oom_kill", 0)
        keys = _read_keys(self.memory / "memory.oom_control")
        return keys.get("oom_kill", keys.get("under_oom", 0))

    def refused_forks(self) -> int:
        return 0 if self.pids is None else _read_keys(self.pids / "pids.events").get("max", 0)

    def peak_mb(self) -> float | None:
        if self.memory is None:
            return None
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return round(int((self.memory / name).read_text()) / 2**20, 1)
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL every process in the run's cgroups until none is left (bounded)."""
        if self.version == 2 and self.memory is not None:
            with contextlib.suppress(OSError):
                _write(self.memory / "cgroup.kill", 1)
        kill_until_gone(self.processes, attempts=200, pause_s=0.005)

    def remove(self) -> None:
        for folder in reversed(self.folders):
            for _ in range(200):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY:
                        break
                    self.kill()
                    time.sleep(0.005)
        self.folders = []


def kill_until_gone(alive: Callable[[], list[int]], *, attempts: int, pause_s: float) -> None:
    """SIGKILL the processes ``alive()`` names, again after ``pause_s``, until it names none
    (at most ``attempts`` rounds: a process that forks as fast as it is killed is bounded)."""
    for _ in range(attempts):
        pids = alive()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(pause_s)
