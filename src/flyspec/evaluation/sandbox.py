"""Run untrusted generated code in separate, limited processes, with a verdict it cannot forge.

``run_sandboxed(code, timeout_s=..., memory_mb=..., check=Check(...))`` runs ``code`` and says
whether it passed. Whatever the code does (loops forever, forks without end, allocates without
end, writes files, opens sockets, calls exit, crashes the interpreter, lies about its result),
the call returns a :class:`SandboxResult`; it raises only for bad arguments and, as
:class:`SandboxUnavailable`, when ``FLYSPEC_SANDBOX`` is invalid or no allowed backend works
here. docs/sandbox.md is the reference page.

The verdict. Each run has two processes inside the sandbox. The *supervisor* runs trusted code
only: it makes itself non-dumpable (so a process of the same uid can neither ptrace it, read its
memory nor open its descriptors through ``/proc``), then starts the *candidate*, a fresh
interpreter holding nothing but two pipe ends, which runs the program. With a :class:`Check`
(HumanEval), the supervisor loads the trusted tests itself and calls the program's function
through the pipes: arguments go out and return values come back as plain data (None, bool,
numbers, str, bytes, list, tuple, dict, set), rebuilt as fresh builtin objects, so the
program's frames, objects, builtins and ``__eq__`` never reach the tests. The supervisor writes
the verdict to a socket inherited from the host that the candidate never holds (a socket cannot
be opened through ``/proc/<pid>/fd``). A candidate that exits, crashes, prints a fake result or
writes to every descriptor it has can make the run fail, never pass. Without a check (a bare
program), "passed" means the program reported that it ran to its end: that report comes from
the program's own process and a hostile program can fake it.

Two backends; ``FLYSPEC_SANDBOX`` picks one (unset or ``auto``: ``namespaces`` for root,
``plain`` otherwise):

``namespaces`` (root, util-linux ``unshare``, ``setpriv`` and ``mount`` present)
    New mount, network and PID namespaces; both processes run as uid/gid 65534 (``nobody``)
    with no supplementary groups, no capabilities and ``no_new_privs``. The network namespace
    holds only a downed loopback: nothing can be reached. ``/`` is remounted read-only; ``/tmp``
    is a fresh size-limited tmpfs whose ``work`` folder is the current directory; the other
    world-writable folders and the user's folders are covered by empty read-only mounts. The
    supervisor is PID 1 of the namespace: when it ends or is killed, every process of the run
    dies (a child that calls ``setsid`` or double-forks cannot escape).
``plain`` (not root; as root only as ``FLYSPEC_SANDBOX=plain-as-root-UNSAFE``)
    The processes run as the calling user in a private temporary folder: limits, the
    process-tree kill and the audit hook apply; nothing stops the program from writing where the
    user can write, or from attacking the caller, which runs under the same uid.

Run-wide limits. ``memory_mb`` bounds all processes of a run together and ``max_processes``
their number: in a cgroup of its own when one can be made (cgroup v2 with the memory and pids
controllers, else v1 ``memory`` and ``pids`` hierarchies), else by a watchdog in the host that
sums the proportional memory (PSS) of the run's process tree and counts it every 20 ms, killing
the whole run over budget. Per process, ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU``,
``RLIMIT_FSIZE`` and ``RLIMIT_NOFILE`` apply too; the wall-clock limit kills the whole run.
A ``sys.addaudithook`` hook refuses sockets in the candidate (a speed bump: only the network
namespace is a wall).

Residual weaknesses (docs/sandbox.md lists them all). With a check, the program still decides
its function's results for the arguments it sees, and which builtin exception type a call
raises; it cannot see the tests, and the attacks on single-interpreter harnesses such as the
official HumanEval one (patching the builtins the tests use, objects whose ``==`` is always
true, patching the check function's globals; ``builtins.AssertionError`` replaced, which never
changes what ``assert`` raises but changes what ``except AssertionError`` catches) reach only
the candidate's own interpreter. Only plain data crosses, so a function returning anything else
is an ``error`` even where ``==`` would hold. A bare program's pass is its own claim. In
``plain`` the program can attack the caller (same uid), and as root nothing is guaranteed. The
watchdog samples: a run can overshoot its memory budget by what it allocates in one interval.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from flyspec.errors import FlyspecError
from flyspec.evaluation import _sandbox_limits as run_limits
from flyspec.evaluation._sandbox_backends import (
    DEFAULT_MAX_FILE_MB,
    DEFAULT_MAX_PROCESSES,
    SAFE_PATH,
    Backend,
    BackendName,
    Check,
    NamespaceBackend,
    SandboxResult,
    Status,
    one_line,
)

__all__ = [
    "Check",
    "SandboxInfo",
    "SandboxResult",
    "SandboxUnavailable",
    "Status",
    "run_sandboxed",
    "sandbox_info",
]

ENV_VARIABLE = "FLYSPEC_SANDBOX"
ROOT_PLAIN_OPT_IN = "plain-as-root-UNSAFE"
SANDBOX_VALUES = ("auto", "namespaces", "plain", ROOT_PLAIN_OPT_IN)


class SandboxUnavailable(FlyspecError):
    """``FLYSPEC_SANDBOX`` is invalid, or no backend it allows works on this machine."""


@dataclass(frozen=True)
class SandboxInfo:
    """The backend in use and the guarantees it gives (for reports)."""

    backend: BackendName
    interpreter: str
    guarantees: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    run_limits: str = ""

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "interpreter": self.interpreter,
            "run_limits": self.run_limits,
            "guarantees": list(self.guarantees),
            "notes": list(self.notes),
        }


_lock = threading.Lock()
_chosen: tuple[str, SandboxInfo, Backend] | None = None


def run_sandboxed(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_file_mb: int = DEFAULT_MAX_FILE_MB,
    check: Check | None = None,
) -> SandboxResult:
    """Run ``code`` under the limits; with ``check``, judge its ``check.entry_point`` by the
    trusted tests. Never raises for what the program does (see :class:`SandboxResult`)."""
    if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0 or max_file_mb <= 0:
        raise ValueError("timeout_s, memory_mb, max_processes and max_file_mb must be positive")
    if check is not None and not (
        check.entry_point.isidentifier() and check.function.isidentifier()
    ):
        raise ValueError("check.entry_point and check.function must be Python identifiers")
    _, backend = _backend()
    return backend.run(
        code,
        check,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
    )


def sandbox_info() -> SandboxInfo:
    """Which backend :func:`run_sandboxed` uses here (chosen and checked on first use);
    raises :class:`SandboxUnavailable` when ``FLYSPEC_SANDBOX`` allows none that works."""
    return _backend()[0]


# ---------------------------------------------------------------------------- choosing one


def _world_accessible(path: str) -> bool:
    """True when user ``nobody`` could reach and execute ``path`` (mode bits only)."""
    real = Path(os.path.realpath(path))
    try:
        if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)
    except OSError:
        return False


def _interpreter_for_nobody() -> str | None:
    """A Python interpreter ``nobody`` can run: ours when reachable, else the system's."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates: list[str] = [sys.executable, getattr(sys, "_base_executable", "")]
    for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
        candidates += [f"{folder}/{version}", f"{folder}/python3"]
    for candidate in candidates:
        if candidate and _world_accessible(candidate):
            return os.path.realpath(candidate)
    return None


def _requested() -> str:
    """The backend ``FLYSPEC_SANDBOX`` asks for; :class:`SandboxUnavailable` if unknown."""
    value = os.environ.get(ENV_VARIABLE, "").strip()
    if not value:
        return "auto"
    if value in SANDBOX_VALUES:
        return value
    removed = (
        " (the setuid backend was removed: it could neither contain a program's processes nor "
        "cut its network)"
        if value == "setuid"
        else ""
    )
    raise SandboxUnavailable(
        f"{ENV_VARIABLE}={value!r} is not a sandbox backend{removed}; valid values: auto (the "
        f"default), namespaces, plain, {ROOT_PLAIN_OPT_IN}"
    )


def _backend() -> tuple[SandboxInfo, Backend]:
    global _chosen
    with _lock:
        requested = _requested()
        if _chosen is None or _chosen[0] != requested:
            info, backend = _choose(requested)
            _chosen = (requested, info, backend)
        return _chosen[1], _chosen[2]


def _namespace_backend() -> tuple[NamespaceBackend | None, str]:
    """The namespaces backend, or None and why it is unavailable."""
    interpreter = _interpreter_for_nobody()
    if interpreter is None:
        return None, "no Python interpreter that user nobody may run"
    tools = {name: shutil.which(name, path=SAFE_PATH) for name in ("unshare", "setpriv", "sh")}
    tools["mount"] = shutil.which("mount", path=SAFE_PATH)
    missing = [name for name, path in tools.items() if not path]
    if missing:
        return None, f"{', '.join(missing)} not found in {SAFE_PATH}"
    return NamespaceBackend(interpreter, tools), ""  # type: ignore[arg-type]


def _choose(requested: str) -> tuple[SandboxInfo, Backend]:
    root = os.geteuid() == 0
    unsafe_hint = (
        f"set {ENV_VARIABLE}={ROOT_PLAIN_OPT_IN} to run generated code as root without isolation"
    )
    if requested == "plain" and root:
        raise SandboxUnavailable(
            f"{ENV_VARIABLE}=plain would run generated code as root (uid 0) without isolation; "
            f"use namespaces (the default for root), run flyspec as a non-root user, or "
            f"{unsafe_hint}"
        )
    if requested in ("plain", ROOT_PLAIN_OPT_IN) or (requested == "auto" and not root):
        notes = (
            (f"UNSAFE: {ENV_VARIABLE}={ROOT_PLAIN_OPT_IN}: generated code runs as root",)
            if root
            else ()
        )
        return _probed(Backend(sys.executable), requested, notes, hint="")
    if not root:
        raise SandboxUnavailable(
            f"{ENV_VARIABLE}=namespaces needs root (it switches the program to user nobody); "
            "unset it to use the plain backend"
        )
    backend, why = _namespace_backend()
    if backend is None:
        raise SandboxUnavailable(
            f"{_asked(requested)}: the namespaces backend is unavailable here ({why}); "
            f"install util-linux, run flyspec as a non-root user, or {unsafe_hint}"
        )
    hint = f"; run flyspec as a non-root user, or {unsafe_hint}"
    return _probed(backend, requested, (), hint=hint)


def _asked(requested: str) -> str:
    """How an error names what the user asked for."""
    if requested == "auto":
        return f"the default sandbox ({ENV_VARIABLE} unset or auto)"
    return f"{ENV_VARIABLE}={requested}"


_PROBE_CODE = "def f(x):\n    return x + 1\n\nprint('ok')\n"
_PROBE_CHECK = Check(tests="def check(candidate):\n    assert candidate(1) == 2\n", entry_point="f")


def _probe(backend: Backend) -> SandboxResult:
    return backend.run(
        _PROBE_CODE, _PROBE_CHECK, timeout_s=20, memory_mb=512, max_processes=8, max_file_mb=1
    )


def _probed(
    backend: Backend, requested: str, notes: tuple[str, ...], *, hint: str
) -> tuple[SandboxInfo, Backend]:
    """The backend once a trivial checked program passed through it; with per-run cgroups
    when they work, else with the watchdog."""
    kept = list(notes)
    backend.cgroups = run_limits.cgroup_plan()
    probe = _probe(backend)
    if not probe.passed and backend.cgroups is not None:
        kept.append(
            f"cgroups unusable ({backend.cgroups.describe()}: {one_line(probe.detail)}); "
            "run-wide limits by the watchdog"
        )
        backend.cgroups = None
        probe = _probe(backend)
    if not probe.passed:
        raise SandboxUnavailable(
            f"{_asked(requested)}: the {backend.name} backend does not work here "
            f"({probe.status}: {one_line(probe.detail)}){hint}"
        )
    enforced = "watchdog" if backend.cgroups is None else backend.cgroups.short()
    info = SandboxInfo(
        backend.name, backend.interpreter, backend.guarantees(), tuple(kept), enforced
    )
    return info, backend
