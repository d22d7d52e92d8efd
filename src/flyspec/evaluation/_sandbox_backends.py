"""The sandbox's two backends, ``plain`` and ``namespaces``, and what one run gets and returns.

:mod:`flyspec.evaluation.sandbox` chooses a backend and is the public face; the reference is
its docstring and docs/sandbox.md. The in-sandbox program is ``_sandbox_child.py``, and the
run-wide limits (cgroups, watchdog) are in ``_sandbox_limits.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flyspec.evaluation import _sandbox_limits as run_limits

Status = Literal["passed", "failed", "timeout", "killed", "error"]
BackendName = Literal["namespaces", "plain"]

NOBODY = 65534
DEFAULT_MAX_PROCESSES = 32
DEFAULT_MAX_FILE_MB = 16
DEFAULT_MAX_OPEN_FILES = 64
_DETAIL_CHARS = 1500
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_CHILD_SOURCE = (Path(__file__).with_name("_sandbox_child.py")).read_text(encoding="utf-8")


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

# ---------------------------------------------------------------------------------- backends


class Backend:
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


class NamespaceBackend(Backend):
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
    return shutil.which("sh", path=SAFE_PATH) or "/bin/sh"


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
        "PATH": SAFE_PATH,
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


def one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


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
