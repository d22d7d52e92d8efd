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

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from flyspec.errors import FlyspecError
from flyspec.evaluation import _sandbox_limits as run_limits

Status = Literal["passed", "failed", "timeout", "killed", "error"]
BackendName = Literal["namespaces", "plain"]

NOBODY = 65534
DEFAULT_MAX_PROCESSES = 32
DEFAULT_MAX_FILE_MB = 16
DEFAULT_MAX_OPEN_FILES = 64
ENV_VARIABLE = "FLYSPEC_SANDBOX"
ROOT_PLAIN_OPT_IN = "plain-as-root-UNSAFE"
SANDBOX_VALUES = ("auto", "namespaces", "plain", ROOT_PLAIN_OPT_IN)
_DETAIL_CHARS = 1500
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_CHILD_SOURCE = (Path(__file__).with_name("_sandbox_child.py")).read_text(encoding="utf-8")


class SandboxUnavailable(FlyspecError):
    """``FLYSPEC_SANDBOX`` is invalid, or no backend it allows works on this machine."""


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended.

    ``status``: ``passed`` (the check passed; for a bare program: it reported running to its
    end), ``failed`` (an ``AssertionError``: a test did not hold), ``timeout`` (past the
    wall-clock limit, killed), ``killed`` (over the run's memory or process budget, or ended by
    a signal: CPU-time limit, crash), ``error`` (any other exception, a syntax error, an early
    ``exit()``, a missing result). ``peak_memory_mb``: the run's peak memory, all processes
    together, where it was measured (cgroup or watchdog).
    """

    passed: bool
    status: Status
    detail: str
    seconds: float = 0.0
    peak_memory_mb: float | None = None


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


@dataclass(frozen=True)
class Check:
    """Trusted tests that judge the program's function from another process.

    ``tests`` defines ``function`` (``check(candidate)`` in HumanEval), ``prelude`` is trusted
    code run before it (HumanEval: the problem's prompt, whose helpers some tests use); both run
    in the supervisor, where ``candidate`` and the global ``entry_point`` call the program's
    ``entry_point`` in the candidate process with plain values. The run passes only when
    ``function`` returns normally there.
    """

    tests: str
    entry_point: str
    prelude: str = ""
    function: str = "check"

    def as_payload(self) -> dict:
        return {
            "tests": self.tests,
            "entry_point": self.entry_point,
            "prelude": self.prelude,
            "function": self.function,
        }


_NAMESPACE_SETUP = """set -e
mount -o remount,bind,ro /
mount -t tmpfs -o size={tmp_mb}m,mode=0755,nosuid,nodev tmpfs /tmp
mkdir -m 0700 /tmp/work
chown {uid}:{uid} /tmp/work
for hidden in {hidden}; do
  if [ -d "$hidden" ] && [ ! -L "$hidden" ]; then
    mount -t tmpfs -o ro,size=4k,mode=0755,nosuid,nodev tmpfs "$hidden"
  fi
done
cd /tmp/work
exec "$@"
"""

# Moves itself into the run's cgroups (``0`` is the writing process), then becomes the command:
# every process of the run starts inside them.
_JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'

_lock = threading.Lock()
_chosen: tuple[str, SandboxInfo, _Backend] | None = None


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


# ---------------------------------------------------------------------------------- backends


class _Backend:
    """The ``plain`` backend: the calling user, a private folder, limits, a tree kill."""

    name: BackendName = "plain"
    uid: int | None = None  # the uid the run's processes have (None: the caller's)

    def __init__(self, interpreter: str) -> None:
        self.interpreter = interpreter
        self.cgroups: run_limits.CgroupPlan | None = None

    def guarantees(self) -> tuple[str, ...]:
        user = "root (uid 0): NO isolation at all" if os.geteuid() == 0 else "the calling user"
        return (
            "a supervisor and a candidate process per program (`python -I`), in a fresh "
            f"temporary working folder deleted afterwards, as {user}",
            _VERDICT_GUARANTEE + "; but the program runs under the caller's uid and can attack "
            "the caller itself (signals, ptrace where the kernel allows it, the user's files)",
            "wall-clock limit: the run's process group and process tree are killed (SIGKILL); "
            "a process that leaves both (setsid after its supervisor died) can survive",
            _run_limits_text(self.cgroups, "process tree and session"),
            _RLIMITS_GUARANTEE,
            "socket creation refused by an audit hook in the interpreter (bypassable by "
            "determined code, e.g. through ctypes)",
            "writes are limited only by the calling user's own permissions",
        )

    def _prepare(self, host_dir: Path, settings: str, max_file_mb: int) -> tuple[list[str], dict]:
        """The command and the Popen keyword arguments (cwd, ...)."""
        work = host_dir / "work"
        work.mkdir(mode=0o700)
        return self._python_command(settings), {"cwd": str(work)}

    def _python_command(self, settings: str) -> list[str]:
        return [self.interpreter, "-I", "-c", _CHILD_SOURCE, "supervise", settings]

    def run(
        self,
        code: str,
        check: Check | None,
        *,
        timeout_s: float,
        memory_mb: int,
        max_processes: int,
        max_file_mb: int,
    ) -> SandboxResult:
        """One run in this backend; host-side failures become an ``error`` result."""
        started = time.monotonic()
        host_dir = Path(tempfile.mkdtemp(prefix="flyspec-sandbox-"))
        cgroup: run_limits.RunCgroup | None = None
        try:
            if self.cgroups is not None:
                with contextlib.suppress(OSError):  # then the watchdog covers this run
                    cgroup = run_limits.RunCgroup(self.cgroups, memory_mb, max_processes)
            nproc = None  # a pids cgroup counts the run; else RLIMIT_NPROC is the backstop
            if cgroup is None or cgroup.pids is None:
                nproc = run_limits.count_processes(self.uid)
                nproc += max_processes + run_limits.OVERHEAD_PROCESSES
            limits = _rlimits(
                timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=max_file_mb, nproc=nproc
            )
            payload = {
                "code": code,
                "check": None if check is None else check.as_payload(),
                "source": _CHILD_SOURCE,
            }
            watch, verdict, output = self._launch(
                payload, limits, host_dir, cgroup, timeout_s, memory_mb, max_processes, max_file_mb
            )
            return _interpret(
                verdict,
                output=output,
                returncode=watch.process.returncode,
                timed_out=watch.timed_out,
                timeout_s=timeout_s,
                violation=watch.violation,
                note=watch.note(),
                seconds=time.monotonic() - started,
                peak_mb=watch.peak_mb(),
            )
        except Exception as error:  # a host-side failure is the run's error, never the caller's
            return SandboxResult(False, "error", f"the sandbox could not run it: {error!r}")
        finally:
            if cgroup is not None:
                cgroup.remove()
            shutil.rmtree(host_dir, ignore_errors=True)

    def _launch(
        self,
        payload: dict,
        limits: dict,
        host_dir: Path,
        cgroup: run_limits.RunCgroup | None,
        timeout_s: float,
        memory_mb: int,
        max_processes: int,
        max_file_mb: int,
    ) -> tuple[run_limits.Watch, dict | None, str]:
        """Start the supervisor, wait for the run (watched), and collect the verdict and the
        tail of the output."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours:
            try:
                settings = json.dumps({"limits": limits, "verdict_fd": theirs.fileno()})
                command, popen_kwargs = self._prepare(host_dir, settings, max_file_mb)
                if cgroup is not None:
                    joiner = [_shell(), "-c", _JOIN_CGROUPS, "flyspec-join"]
                    command = [*joiner, *cgroup.procs_files(), "--", *command]
                output_path = host_dir / "output.txt"
                # No path names the payload (tests included): only the supervisor's stdin does.
                with tempfile.TemporaryFile(dir=host_dir) as stdin, open(output_path, "wb") as out:
                    stdin.write(json.dumps(payload).encode("utf-8", "surrogatepass"))
                    stdin.seek(0)
                    process = subprocess.Popen(
                        command,
                        stdin=stdin,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=_child_env(),
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(theirs.fileno(),),
                        **popen_kwargs,
                    )
            finally:
                theirs.close()  # from here on only the supervisor holds the other end
            watch = run_limits.Watch(
                process, cgroup, memory_mb, max_processes, by_namespace=self.name == "namespaces"
            )
            watch.wait(timeout_s)
            verdict = _read_verdict(ours)
        with open(output_path, "rb") as handle:
            handle.seek(max(0, output_path.stat().st_size - 65536))
            return watch, verdict, handle.read().decode("utf-8", "replace")


class _NamespaceBackend(_Backend):
    name: BackendName = "namespaces"
    uid = NOBODY

    def __init__(self, interpreter: str, tools: dict[str, str]) -> None:
        super().__init__(interpreter)
        self.tools = tools

    def guarantees(self) -> tuple[str, ...]:
        return (
            "a supervisor and a candidate process per program (`python -I`), in new mount, "
            "network and PID namespaces (util-linux unshare)",
            "runs as uid/gid 65534 (nobody), no supplementary groups, no capabilities, "
            "no_new_privs (setpriv)",
            _VERDICT_GUARANTEE,
            "no network: the network namespace has only a downed loopback device",
            "filesystem: / remounted read-only; /tmp is a private size-limited tmpfs whose "
            "work folder is the current directory and vanishes with the namespace; /dev/shm, "
            "/var/tmp, /run/lock and the user's folders are hidden under empty read-only mounts",
            "wall-clock limit: the run is killed; the supervisor is PID 1 of the namespace, so "
            "every process of the run dies with it",
            _run_limits_text(self.cgroups, "PID namespace"),
            _RLIMITS_GUARANTEE,
            "socket creation also refused by an audit hook",
        )

    def _prepare(self, host_dir, settings, max_file_mb):
        hidden = " ".join(shlex.quote(p) for p in _hidden_folders(self.interpreter))
        script = _NAMESPACE_SETUP.format(
            tmp_mb=max(64, 4 * max_file_mb), uid=NOBODY, hidden=hidden or "''"
        )
        t = self.tools
        command = [
            t["unshare"],
            "--mount",
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--",
            t["sh"],
            "-c",
            script,
            "flyspec-sandbox",
            t["setpriv"],
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--no-new-privs",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
            *self._python_command(settings),
        ]
        return command, {"cwd": "/"}


_VERDICT_GUARANTEE = (
    "verdict: with a Check, the trusted tests run in a separate, non-dumpable supervisor "
    "process that calls the program's function through pipes with plain values and alone holds "
    "the verdict socket: the program can make a run fail, not pass (a bare program's result is "
    "its own report)"
)
_RLIMITS_GUARANTEE = (
    "per process: RLIMIT_AS (memory_mb), RLIMIT_CPU (the wall-clock limit), RLIMIT_FSIZE, "
    "RLIMIT_NOFILE, no core files; RLIMIT_NPROC as a backstop where no pids cgroup counts the run"
)


def _run_limits_text(plan: run_limits.CgroupPlan | None, scope: str) -> str:
    watchdog = (
        f"a watchdog in the host sums the memory (PSS) of the run's {scope} and counts its "
        f"processes every {run_limits.WATCH_S * 1000:.0f} ms, and kills the whole run over budget"
    )
    if plan is None:
        return f"run-wide limits (memory_mb for all processes together, max_processes): {watchdog}"
    text = (
        f"run-wide limits: {plan.describe()}; over memory_mb (all processes together) the whole "
        "run is killed, forks past max_processes are refused"
    )
    if plan.memory is None or plan.pids is None:
        text += f"; for the controller missing, {watchdog}"
    return text


def _shell() -> str:
    return shutil.which("sh", path=_SAFE_PATH) or "/bin/sh"


def _rlimits(
    *, timeout_s: float, memory_mb: int, max_file_mb: int, nproc: int | None
) -> dict[str, tuple[int, int]]:
    cpu = max(1, int(timeout_s + 0.999))
    limits = {
        "RLIMIT_AS": (memory_mb << 20, memory_mb << 20),
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_FSIZE": (max_file_mb << 20, max_file_mb << 20),
        "RLIMIT_NOFILE": (DEFAULT_MAX_OPEN_FILES, DEFAULT_MAX_OPEN_FILES),
        "RLIMIT_CORE": (0, 0),
    }
    if nproc is not None:
        limits["RLIMIT_NPROC"] = (nproc, nproc)
    return limits


def _child_env() -> dict[str, str]:
    return {
        "PATH": _SAFE_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": "/nonexistent",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _read_verdict(sock: socket.socket) -> dict | None:
    """The supervisor's verdict, if it wrote a well-formed one."""
    sock.setblocking(False)
    data = b""
    while len(data) < 1 << 20:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    try:
        verdict = json.loads(data.split(b"\n", 1)[0].decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(verdict, dict):
        return None
    if verdict.get("status") not in ("passed", "failed", "error", "killed"):
        return None
    if not isinstance(verdict.get("detail", ""), str):
        return None
    return verdict


def _interpret(
    verdict: dict | None,
    *,
    output: str,
    returncode: int,
    timed_out: bool,
    timeout_s: float,
    violation: str | None,
    note: str,
    seconds: float,
    peak_mb: float | None,
) -> SandboxResult:
    def result(status: Status, detail: str) -> SandboxResult:
        return SandboxResult(status == "passed", status, detail, seconds, peak_mb)

    tail = output.strip()[-_DETAIL_CHARS:]
    if timed_out:
        return result("timeout", _join(f"killed after the {timeout_s:g}s wall-clock limit", tail))
    if violation is not None:
        return result("killed", _join(violation, tail))
    if verdict is not None:
        detail = verdict.get("detail", "")
        if verdict.get("tail"):
            detail = _join(detail, tail)
        if note and verdict["status"] != "passed":
            detail = _join(detail, note)
        return result(verdict["status"], detail)
    signal_number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if signal_number > 0:
        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = f"signal {signal_number}"
        hint = {"SIGKILL": " (CPU-time limit or out of memory)", "SIGXCPU": " (CPU-time limit)"}
        return result("killed", _join(f"killed by {name}{hint.get(name, '')}", tail))
    message = f"the sandbox ended (status {returncode}) without a verdict"
    return result("error", _join(_join(message, note), tail))


def _join(message: str, tail: str) -> str:
    if not message:
        return tail
    return f"{message}\n{tail}" if tail else message


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


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


def _hidden_folders(interpreter: str) -> list[str]:
    """World-writable scratch folders and the user's folders, minus any that hold the
    interpreter (it must stay reachable)."""
    candidates = ["/dev/shm", "/var/tmp", "/run/lock", "/var/lock", "/root", "/home"]
    candidates += [str(Path.home()), os.getcwd(), os.environ.get("FLYSPEC_HOME", "")]
    interpreter_path = Path(interpreter)
    chosen: list[str] = []
    for folder in candidates:
        if not folder:
            continue
        path = Path(os.path.realpath(folder))
        if str(path) in ("/", "/tmp", "/usr", "/bin", "/lib", "/etc") or str(path) in chosen:
            continue
        if path == interpreter_path or path in interpreter_path.parents:
            continue
        if path.is_dir():
            chosen.append(str(path))
    return chosen


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


def _backend() -> tuple[SandboxInfo, _Backend]:
    global _chosen
    with _lock:
        requested = _requested()
        if _chosen is None or _chosen[0] != requested:
            info, backend = _choose(requested)
            _chosen = (requested, info, backend)
        return _chosen[1], _chosen[2]


def _namespace_backend() -> tuple[_NamespaceBackend | None, str]:
    """The namespaces backend, or None and why it is unavailable."""
    interpreter = _interpreter_for_nobody()
    if interpreter is None:
        return None, "no Python interpreter that user nobody may run"
    tools = {name: shutil.which(name, path=_SAFE_PATH) for name in ("unshare", "setpriv", "sh")}
    tools["mount"] = shutil.which("mount", path=_SAFE_PATH)
    missing = [name for name, path in tools.items() if not path]
    if missing:
        return None, f"{', '.join(missing)} not found in {_SAFE_PATH}"
    return _NamespaceBackend(interpreter, tools), ""  # type: ignore[arg-type]


def _choose(requested: str) -> tuple[SandboxInfo, _Backend]:
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
        return _probed(_Backend(sys.executable), requested, notes, hint="")
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


def _probe(backend: _Backend) -> SandboxResult:
    return backend.run(
        _PROBE_CODE, _PROBE_CHECK, timeout_s=20, memory_mb=512, max_processes=8, max_file_mb=1
    )


def _probed(
    backend: _Backend, requested: str, notes: tuple[str, ...], *, hint: str
) -> tuple[SandboxInfo, _Backend]:
    """The backend once a trivial checked program passed through it; with per-run cgroups
    when they work, else with the watchdog."""
    kept = list(notes)
    backend.cgroups = run_limits.cgroup_plan()
    probe = _probe(backend)
    if not probe.passed and backend.cgroups is not None:
        kept.append(
            f"cgroups unusable ({backend.cgroups.describe()}: {_one_line(probe.detail)}); "
            "run-wide limits by the watchdog"
        )
        backend.cgroups = None
        probe = _probe(backend)
    if not probe.passed:
        raise SandboxUnavailable(
            f"{_asked(requested)}: the {backend.name} backend does not work here "
            f"({probe.status}: {_one_line(probe.detail)}){hint}"
        )
    enforced = "watchdog" if backend.cgroups is None else backend.cgroups.short()
    info = SandboxInfo(
        backend.name, backend.interpreter, backend.guarantees(), tuple(kept), enforced
    )
    return info, backend
