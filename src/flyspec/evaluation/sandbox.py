"""Run untrusted generated code in a separate, limited process.

``run_sandboxed(code, timeout_s=..., memory_mb=...)`` runs ``code`` as a fresh ``python -I``
program and says whether it finished without an exception. Whatever the code does (loops
forever, forks without end, allocates without end, writes files, opens sockets, calls exit,
crashes the interpreter), the call returns a :class:`SandboxResult` and never raises.

Three backends, the strongest that works on this machine is chosen once per process (a trivial
program must pass through it first):

``namespaces`` (root, util-linux ``unshare``, ``setpriv`` and ``mount`` present)
    The program runs in new mount, network and PID namespaces, as uid/gid 65534 (``nobody``)
    with no supplementary groups, no capabilities and ``no_new_privs``. The network namespace
    holds only a downed loopback: nothing can be reached. ``/`` is remounted read-only in the
    private mount namespace; ``/tmp`` is a fresh size-limited tmpfs whose ``work`` folder (owned
    by ``nobody``) is the current directory, gone when the namespace ends; the other
    world-writable folders (``/dev/shm``, ``/var/tmp``, ``/run/lock``) and the user's folders
    (home, ``/root``, ``/home``, the caller's working directory) are covered by empty
    read-only tmpfs mounts. The program is PID 1 of its namespace, so when it ends or is killed
    every process it started dies with it (a child that calls ``setsid`` cannot escape).
``setuid`` (root without namespaces)
    The program runs as ``nobody`` in a private temporary folder. Writes are refused wherever
    ``nobody`` has no permission, but world-writable folders such as ``/tmp`` stay writable,
    and the network is only blocked by the audit hook below.
``plain`` (not root)
    The program runs as the calling user in a private temporary folder: the resource limits,
    the process-group kill and the audit hook apply, nothing stops it from writing where the
    user can write.

In every backend: the wall-clock limit kills the whole process group; resource limits cap
address space (``RLIMIT_AS``), CPU time, file size and open files, and the number of processes
(``RLIMIT_NPROC``, which the kernel does not enforce for root: that is why the root backends
switch to ``nobody``); a ``sys.addaudithook`` hook refuses to create sockets (a hook in the same
interpreter is a speed bump, not a wall: only the network namespace is a real guarantee); the
code is passed on standard input, and its result travels back on a line tagged with a random
nonce, so printing "passed" or calling ``exit(0)`` early cannot fake a pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["passed", "failed", "timeout", "killed", "error"]
BackendName = Literal["namespaces", "setuid", "plain"]

NOBODY = 65534
DEFAULT_MAX_PROCESSES = 32
DEFAULT_MAX_FILE_MB = 16
DEFAULT_MAX_OPEN_FILES = 64
_DETAIL_CHARS = 1500
_POLL_S = 0.005
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended.

    ``status``: ``passed`` (ran to the end), ``failed`` (an ``AssertionError``: the tests ran and
    one did not hold), ``timeout`` (past the wall-clock limit, killed), ``killed`` (ended by a
    signal: CPU-time limit, crash), ``error`` (any other exception, a syntax error, an early
    ``exit()``, a missing result, or a sandbox that could not start).
    """

    passed: bool
    status: Status
    detail: str
    seconds: float = 0.0


@dataclass(frozen=True)
class SandboxInfo:
    """The backend in use and the guarantees it gives (for reports)."""

    backend: BackendName
    interpreter: str
    guarantees: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "interpreter": self.interpreter,
            "guarantees": list(self.guarantees),
            "notes": list(self.notes),
        }


# Runs inside the sandboxed interpreter as ``python -I -c BOOTSTRAP LIMITS_JSON``; standard input
# holds the nonce on the first line, then the program.
_BOOTSTRAP = r"""
import os, sys
def _flyspec_sandbox():
    import json, linecache, resource, traceback
    limits = json.loads(sys.argv[1])
    data = sys.stdin.buffer.read()
    nonce, _, code = data.decode("utf-8", "replace").partition("\n")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    for name, (soft, hard) in limits.items():
        kind = getattr(resource, name)
        old_soft, old_hard = resource.getrlimit(kind)
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
            soft = min(soft, hard)
        resource.setrlimit(kind, (soft, hard))

    def refuse_network(event, args):
        if event == "socket.__new__":
            raise PermissionError("network access is disabled in the flyspec sandbox")

    sys.addaudithook(refuse_network)
    result_fd = os.dup(1)
    pid = os.getpid()
    filename = "<program>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    status, detail = "passed", ""

    def describe():
        kind, error, trace = sys.exc_info()
        try:
            lines = traceback.format_exception(kind, error, trace.tb_next)
            return "".join("".join(lines).splitlines(True)[-12:])
        except BaseException:
            return kind.__name__

    try:
        program = compile(code, filename, "exec")
        exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
    except AssertionError:
        status, detail = "failed", describe()
    except SystemExit as stop:
        status = "error"
        detail = "the program called exit(%r) before it finished" % (stop.code,)
    except BaseException:
        status, detail = "error", describe()
    if os.getpid() != pid:
        os._exit(1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    line = "\n%s %s\n" % (nonce, json.dumps({"status": status, "detail": detail[-2000:]}))
    try:
        os.write(result_fd, line.encode("utf-8", "replace"))
    finally:
        os._exit(0)
_flyspec_sandbox()
"""

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

_lock = threading.Lock()
_chosen: tuple[SandboxInfo, _Backend] | None = None


def run_sandboxed(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_file_mb: int = DEFAULT_MAX_FILE_MB,
) -> SandboxResult:
    """Run ``code`` as a fresh Python program under the limits; never raises for what the
    program does (see :class:`SandboxResult` for the statuses)."""
    if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0 or max_file_mb <= 0:
        raise ValueError("timeout_s, memory_mb, max_processes and max_file_mb must be positive")
    _, backend = _backend()
    return backend.run(
        code,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
    )


def sandbox_info() -> SandboxInfo:
    """Which backend :func:`run_sandboxed` uses here (chosen and checked on first use)."""
    return _backend()[0]


class _Backend:
    name: BackendName = "plain"

    def __init__(self, interpreter: str) -> None:
        self.interpreter = interpreter

    def guarantees(self) -> tuple[str, ...]:
        return (
            "separate process per program, `python -I`, fresh temporary working folder "
            "deleted afterwards",
            "wall-clock limit: the whole process group is killed (SIGKILL)",
            "RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC "
            + ("(not enforced by the kernel for root)" if os.geteuid() == 0 else ""),
            "socket creation refused by an audit hook in the interpreter (bypassable by "
            "determined code, e.g. through ctypes)",
            "writes are limited only by the calling user's own permissions",
        )

    def _limits(self, *, timeout_s, memory_mb, max_processes, max_file_mb) -> dict:
        cpu = max(1, int(timeout_s + 0.999))
        return {
            "RLIMIT_AS": (memory_mb << 20, memory_mb << 20),
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_FSIZE": (max_file_mb << 20, max_file_mb << 20),
            "RLIMIT_NOFILE": (DEFAULT_MAX_OPEN_FILES, DEFAULT_MAX_OPEN_FILES),
            "RLIMIT_NPROC": (max_processes, max_processes),
            "RLIMIT_CORE": (0, 0),
        }

    def _python_command(self, limits: dict) -> list[str]:
        return [self.interpreter, "-I", "-c", _BOOTSTRAP, json.dumps(limits)]

    def _prepare(self, host_dir: Path, limits: dict, max_file_mb: int) -> tuple[list[str], dict]:
        """The command and the Popen keyword arguments (cwd, user, ...)."""
        work = host_dir / "work"
        work.mkdir(mode=0o700)
        return self._python_command(limits), {"cwd": str(work)}

    def run(self, code, *, timeout_s, memory_mb, max_processes, max_file_mb) -> SandboxResult:
        limits = self._limits(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_processes=max_processes,
            max_file_mb=max_file_mb,
        )
        nonce = secrets.token_hex(16)
        started = time.monotonic()
        host_dir = Path(tempfile.mkdtemp(prefix="flyspec-sandbox-"))
        try:
            command, popen_kwargs = self._prepare(host_dir, limits, max_file_mb)
            program = host_dir / "program.txt"
            program.write_text(f"{nonce}\n{code}", encoding="utf-8")
            output_path = host_dir / "output.txt"
            with open(program, "rb") as stdin, open(output_path, "wb") as output:
                try:
                    process = subprocess.Popen(
                        command,
                        stdin=stdin,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        env=_child_env(),
                        start_new_session=True,
                        close_fds=True,
                        **popen_kwargs,
                    )
                except OSError as error:
                    return SandboxResult(False, "error", f"the sandbox could not start: {error}")
                timed_out = _wait_or_kill(process, timeout_s)
            seconds = time.monotonic() - started
            return _interpret(
                output_path.read_bytes()[-65536:].decode("utf-8", "replace"),
                nonce=nonce,
                returncode=process.returncode,
                timed_out=timed_out,
                timeout_s=timeout_s,
                seconds=seconds,
            )
        except OSError as error:
            return SandboxResult(False, "error", f"sandbox failure: {error}")
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)


class _SetuidBackend(_Backend):
    name: BackendName = "setuid"

    def guarantees(self) -> tuple[str, ...]:
        return (
            "separate process per program, `python -I`, fresh temporary working folder "
            "deleted afterwards",
            "runs as uid/gid 65534 (nobody) without supplementary groups: cannot write the "
            "user's files (but can write world-writable folders such as /tmp)",
            "wall-clock limit: the whole process group is killed (SIGKILL)",
            "RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC "
            "(enforced: the program is not root)",
            "socket creation refused by an audit hook only (no network namespace)",
        )

    def _prepare(self, host_dir, limits, max_file_mb):
        host_dir.chmod(0o711)  # nobody may pass through to its own folder, not list
        work = host_dir / "work"
        work.mkdir(mode=0o700)
        os.chown(work, NOBODY, NOBODY)
        return self._python_command(limits), {
            "cwd": str(work),
            "user": NOBODY,
            "group": NOBODY,
            "extra_groups": [],
        }


class _NamespaceBackend(_Backend):
    name: BackendName = "namespaces"

    def __init__(self, interpreter: str, tools: dict[str, str]) -> None:
        super().__init__(interpreter)
        self.tools = tools

    def guarantees(self) -> tuple[str, ...]:
        return (
            "separate process per program, `python -I`, in new mount, network and PID "
            "namespaces (util-linux unshare)",
            "runs as uid/gid 65534 (nobody), no supplementary groups, no capabilities, "
            "no_new_privs (setpriv)",
            "no network: the network namespace has only a downed loopback device",
            "filesystem: / remounted read-only; /tmp is a private size-limited tmpfs whose "
            "work folder is the current directory and vanishes with the namespace; /dev/shm, "
            "/var/tmp, /run/lock and the user's folders are hidden under empty read-only mounts",
            "wall-clock limit: the process group is killed; the program is PID 1 of its "
            "namespace, so every process it started dies with it",
            "RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC "
            "(enforced: the program is not root)",
            "socket creation also refused by an audit hook",
        )

    def _prepare(self, host_dir, limits, max_file_mb):
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
            *self._python_command(limits),
        ]
        return command, {"cwd": "/"}


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


def _wait_or_kill(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the process without reaping it, kill its whole group (stragglers included),
    then reap it. True when the wall-clock limit was reached."""
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while True:
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        if info is not None:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(_POLL_S)
    # The group leader is not reaped yet, so its process group id still names our group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return timed_out


def _interpret(
    output: str, *, nonce: str, returncode: int, timed_out: bool, timeout_s: float, seconds: float
) -> SandboxResult:
    report = None
    kept: list[str] = []
    for line in output.splitlines():
        if line.startswith(nonce + " "):
            try:
                report = json.loads(line[len(nonce) + 1 :])
            except ValueError:
                report = None
        else:
            kept.append(line)
    tail = "\n".join(kept).strip()[-_DETAIL_CHARS:]
    if timed_out:
        return SandboxResult(
            False,
            "timeout",
            _join(f"killed after the {timeout_s:g}s wall-clock limit", tail),
            seconds,
        )
    if report is not None and returncode == 0:
        status = report.get("status")
        if status in ("passed", "failed", "error"):
            return SandboxResult(status == "passed", status, report.get("detail", ""), seconds)
    signal_number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if signal_number > 0:
        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = f"signal {signal_number}"
        hint = {"SIGKILL": " (CPU-time limit or out of memory)", "SIGXCPU": " (CPU-time limit)"}
        return SandboxResult(
            False, "killed", _join(f"killed by {name}{hint.get(name, '')}", tail), seconds
        )
    return SandboxResult(
        False,
        "error",
        _join(f"the program ended (status {returncode}) without reporting a result", tail),
        seconds,
    )


def _join(message: str, tail: str) -> str:
    return f"{message}\n{tail}" if tail else message


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


def _candidates() -> list[_Backend]:
    backends: list[_Backend] = []
    if os.geteuid() == 0:
        interpreter = _interpreter_for_nobody()
        if interpreter is not None:
            tools = {
                name: shutil.which(name, path=_SAFE_PATH) for name in ("unshare", "setpriv", "sh")
            }
            if all(tools.values()) and shutil.which("mount", path=_SAFE_PATH):
                backends.append(_NamespaceBackend(interpreter, tools))  # type: ignore[arg-type]
            backends.append(_SetuidBackend(interpreter))
    backends.append(_Backend(sys.executable))
    return backends


def _backend() -> tuple[SandboxInfo, _Backend]:
    global _chosen
    with _lock:
        if _chosen is None:
            backends = _candidates()
            forced = os.environ.get("FLYSPEC_SANDBOX")
            if forced:
                backends = [b for b in backends if b.name == forced] or backends[-1:]
            _chosen = _choose(backends)
        return _chosen


def _choose(backends: Sequence[_Backend]) -> tuple[SandboxInfo, _Backend]:
    notes: list[str] = []
    for backend in backends:
        probe = backend.run(
            "print('ok')", timeout_s=20, memory_mb=512, max_processes=8, max_file_mb=1
        )
        if probe.passed:
            info = SandboxInfo(
                backend.name, backend.interpreter, backend.guarantees(), tuple(notes)
            )
            return info, backend
        notes.append(f"backend {backend.name} unavailable: {probe.status}: {probe.detail[:300]}")
    # Even the plain backend failed: keep it, every program will be reported as an error.
    backend = backends[-1]
    return SandboxInfo(
        backend.name, backend.interpreter, backend.guarantees(), tuple(notes)
    ), backend
