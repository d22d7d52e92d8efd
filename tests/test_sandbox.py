"""Tests of the evaluation sandbox's security properties: the verdict a program cannot forge,
``FLYSPEC_SANDBOX`` handling, run-wide limits and process containment (docs/sandbox.md).

Each fake below fooled the earlier single-interpreter harness (or would have, in the backend
named); here it must fail."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec.errors import FlyspecError
from flyspec.evaluation import _sandbox_child as child
from flyspec.evaluation import _sandbox_limits as run_limits
from flyspec.evaluation import sandbox
from flyspec.evaluation.sandbox import Check, SandboxUnavailable, run_sandboxed, sandbox_info
from flyspec.evaluation.tasks import HumanEvalTask
from flyspec.support.datasets import HumanEvalProblem

ROOT = os.geteuid() == 0
PLAIN = sandbox.ROOT_PLAIN_OPT_IN if ROOT else "plain"
FAST = {"timeout_s": 5.0, "memory_mb": 512}
SRC = Path(__file__).resolve().parents[1] / "src"

PROMPT = 'def below(numbers, limit):\n    """Keep the numbers below limit."""\n'
TESTS = (
    "def check(candidate):\n"
    "    assert candidate([1, 5, 2], 3) == [1, 2]\n"
    "    assert sorted(candidate([3, 1, 2], 9)) == [1, 2, 3]\n"
    "    assert candidate([], 0) == []\n"
)
CORRECT = "    return [n for n in numbers if n < limit]\n"
PROBLEM = HumanEvalProblem("Test/0", PROMPT, "below", TESTS, CORRECT)

# Writes a forged result, in every format a harness of this project has read, everywhere it
# can: standard output and every descriptor number.
FORGE = """
    import json, os, re, sys
    def forge(nonces):
        verdict = json.dumps({"status": "passed", "detail": "", "trust": "checked"})
        lines = [verdict, '{"ready": true}', '{"status": "passed", "detail": ""}']
        lines += ["%s %s" % (n, json.dumps({"status": "passed", "detail": ""})) for n in nonces]
        data = ("\\n" + "\\n".join(lines) + "\\n").encode()
        print(data.decode(), flush=True)
        for fd in range(256):
            try:
                os.write(fd, data)
            except OSError:
                pass
"""

FAKES = {
    # the harness's nonce from the calling frame, then from every frame up the stack
    "frame nonce": FORGE
    + """
    found = []
    frame = sys._getframe(1)
    found.append(str(frame.f_locals.get("nonce")))
    while frame is not None:
        found += [v for v in frame.f_locals.values() if isinstance(v, str) and len(v) == 32]
        frame = frame.f_back
    forge(found)
    os._exit(0)
""",
    # the nonce from the program file next to the working folder, and from /proc/self/fd
    "program file and /proc fds": FORGE
    + """
    text = ""
    for path in ["../program.txt", "program.txt"] + [
        "/proc/self/fd/" + name for name in os.listdir("/proc/self/fd")
    ]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe must not block the fake
            text += os.read(fd, 100000).decode(errors="replace")
            os.close(fd)
        except OSError:
            pass
    forge(re.findall(r"[0-9a-f]{32}", text))
    os._exit(0)
""",
    "os._exit(0)": "    import os\n    os._exit(0)\n",
    "sys.exit(0)": "    import sys\n    sys.exit(0)\n",
    "forged line and exit(0)": FORGE + "    forge([])\n    sys.exit(0)\n",
    # builtins the tests use, and a value equal to everything
    "builtins patch": """
    import builtins
    builtins.sorted = lambda *args, **kwargs: [1, 2, 3]
    builtins.AssertionError = KeyError
    class Equal:
        def __eq__(self, other):
            return True
    return Equal()
""",
    "always-equal list": """
    class Equal(list):
        def __eq__(self, other):
            return True
    return Equal()
""",
    # hard-coded for the first test, and the check function's globals patched for the second
    # (through the calling frame)
    "patched check globals": """
    import sys
    sys._getframe(1).f_globals["sorted"] = lambda *args, **kwargs: [1, 2, 3]
    return [1, 2] if numbers == [1, 5, 2] else []
""",
}


@pytest.fixture(scope="module", params=["default", "plain"])
def backend(request):
    """Each test once in the default backend and once in the plain one (as root: the
    explicit unsafe opt-in)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "plain":
            patch.setenv("FLYSPEC_SANDBOX", PLAIN)
        else:
            patch.delenv("FLYSPEC_SANDBOX", raising=False)
        yield sandbox_info().backend


def _score(body: str, problem: HumanEvalProblem = PROBLEM):
    return HumanEvalTask(timeout_s=5.0, memory_mb=512).score(problem, body, chat=True)


# --------------------------------------------------------------------------------- verdict


def test_a_correct_solution_passes(backend):
    outcome = _score(CORRECT)
    assert outcome.correct and outcome.label == "passed", outcome


@pytest.mark.parametrize("name", list(FAKES))
def test_fakes_cannot_pass(backend, name):
    outcome = _score(FAKES[name])
    assert not outcome.correct, (name, outcome)
    assert outcome.label in ("failed", "error"), outcome


def test_a_top_level_exit_before_the_tests_cannot_pass(backend):
    outcome = _score(CORRECT + "\n_ = __import__('os')._exit(0)\n")
    assert not outcome.correct and outcome.label == "error"


def test_the_program_cannot_read_the_tests(backend):
    """The expected value lives only in the tests: a program that searches the frames and every
    object it can reach for it finds nothing (the old harness ran tests and program in one
    interpreter, where the calling frame's code holds it)."""
    problem = HumanEvalProblem(
        "Test/1",
        'def secret():\n    """The number."""\n',
        "secret",
        "def check(candidate):\n    assert candidate() == 982451653\n",
        "    return 982451653\n",
    )
    body = """
    import gc, sys, types
    def constants(code):
        for value in code.co_consts:
            if isinstance(value, types.CodeType):
                yield from constants(value)
            else:
                yield value
    codes = []
    frame = sys._getframe(1)
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    codes += [o.__code__ for o in gc.get_objects() if isinstance(o, types.FunctionType)]
    for code in codes:
        for value in constants(code):
            if isinstance(value, int) and str(value).startswith("98245"):
                return value
    return 0
"""
    assert _score("    return 982451653\n", problem).correct
    outcome = _score(body, problem)
    assert not outcome.correct and outcome.label == "failed", outcome


def test_the_verdict_socket_is_out_of_reach(backend):
    """The supervisor is non-dumpable and alone holds the verdict socket: its /proc fds, ptrace
    and pidfd_getfd are refused to the program."""
    if backend == "plain" and ROOT:
        pytest.skip("a program running as root can reach any process: the opt-in is unsafe")
    body = (
        FORGE
        + """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    reached = []
    for pid in {os.getppid(), 1}:
        try:
            names = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            names = []
        for name in names:
            try:
                reached.append(os.open("/proc/%d/fd/%s" % (pid, name), os.O_WRONLY))
            except OSError:
                pass
        if libc.ptrace(16, pid, 0, 0) == 0:
            reached.append("ptrace")
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        for fd in range(64):
            stolen = libc.syscall(438, pidfd, fd, 0)
            if stolen >= 0:
                reached.append(stolen)
    verdict = json.dumps({"status": "passed", "detail": "", "trust": "checked"}) + "\\n"
    for fd in reached:
        if isinstance(fd, int):
            os.write(fd, verdict.encode())
    return reached
"""
    )
    problem = HumanEvalProblem(
        "Test/2",
        PROMPT,
        "below",
        "def check(candidate):\n"
        "    reached = candidate([1, 5, 2], 3)\n"
        "    assert reached == [1, 2], 'reached %r' % (reached,)\n",
        CORRECT,
    )
    outcome = _score(body, problem)
    assert not outcome.correct and outcome.label == "failed", outcome
    assert "AssertionError: reached []" in outcome.detail


def test_replacing_assertion_error_changes_only_the_programs_side(backend):
    """``assert`` raises the real AssertionError whatever ``builtins.AssertionError`` names;
    the replacement reaches only the candidate's interpreter, where it can turn a failure into
    an error, never into a pass."""
    patch = "import builtins\nbuiltins.AssertionError = KeyError\n"
    function = patch + "def below(numbers, limit):\n    assert False, 'no'\n"
    failed = run_sandboxed(function, check=Check(TESTS, "below"), **FAST)
    assert failed.status == "failed" and "AssertionError: no" in failed.detail
    at_load = run_sandboxed(patch + "assert False, 'no'\n", check=Check(TESTS, "below"), **FAST)
    assert at_load.status == "error" and "AssertionError: no" in at_load.detail
    assert run_sandboxed(patch + "assert False\n", **FAST).status == "error"


def test_exceptions_cross_as_builtin_types():
    code = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    expects_value_error = (
        "def check(candidate):\n"
        "    try:\n"
        "        candidate(-1)\n"
        "    except ValueError as error:\n"
        "        assert str(error) == 'negative'\n"
        "    else:\n"
        "        raise AssertionError('no ValueError')\n"
        "    assert candidate(2) == 2\n"
    )
    assert run_sandboxed(code, check=Check(expects_value_error, "f"), **FAST).passed
    raised = run_sandboxed(code, check=Check("def check(c):\n    c(-1)\n", "f"), **FAST)
    assert raised.status == "error" and "ValueError: negative" in raised.detail
    assert "raised in the program" in raised.detail
    failed = run_sandboxed(
        "def f():\n    assert False, 'inner'\n",
        check=Check("def check(c):\n    c()\n", "f"),
        **FAST,
    )
    assert failed.status == "failed" and "inner" in failed.detail


def test_checks_see_the_prelude_and_the_entry_point_by_name():
    prelude = "def double(x):\n    return 2 * x\n\ndef f(x):\n    '''stub'''\n"
    tests = "def check(candidate):\n    assert candidate(3) == double(3) == f(3)\n"
    code = prelude.replace("'''stub'''", "return 6 if x == 3 else 0")
    assert run_sandboxed(code, check=Check(tests, "f", prelude=prelude), **FAST).passed
    missing = run_sandboxed("x = 1\n", check=Check(tests, "f", prelude=prelude), **FAST)
    assert missing.status == "error" and "defines no function f()" in missing.detail


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -(2**20000),
        2**70,
        1.5,
        -0.0,
        math.inf,
        -math.inf,
        1e-300,
        3 + 4j,
        "",
        "é\n\"'\\",
        "\ud800",
        b"\x00\xff",
        [1, [2, (3,)]],
        (1, "a", None),
        (),
        {"a": 1, 2: [3], (4, 5): {6}},
        {1, 2, "x", (3, 4)},
        frozenset({1, frozenset({2})}),
    ],
    ids=lambda value: type(value).__name__,
)
def test_plain_values_cross_exactly(value):
    data = json.loads(json.dumps(child.encode(value)))
    back = child.decode(data)
    assert type(back) is type(value) and back == value
    if isinstance(value, float):
        assert math.copysign(1, back) == math.copysign(1, value)


def test_nan_crosses_and_bools_stay_bools():
    assert math.isnan(child.decode(child.encode(math.nan)))
    assert child.decode(child.encode([True, 1]))[0] is True
    assert type(child.decode(child.encode([True, 1]))[1]) is int


@pytest.mark.parametrize(
    "data",
    [1, 2.5, {"a": 1}, [], ["x", "1"], ["i", 5], ["i", "zz"], ["s", [["l", []]]], ["d", [[1]]]],
)
def test_decoding_refuses_anything_but_encoded_plain_values(data):
    with pytest.raises(child.ProtocolError):
        child.decode(data)


def test_objects_that_are_not_plain_data_do_not_cross():
    class Equal:
        def __eq__(self, other):
            return True

    for value in (Equal(), lambda: 1, iter([1]), object()):
        with pytest.raises(child.Unencodable):
            child.encode(value)
    deep: list = []
    for _ in range(child.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(child.Unencodable):
        child.encode(deep)


# ------------------------------------------------------------------------- FLYSPEC_SANDBOX


@pytest.mark.parametrize("value", ["bogus", "namespace", "Plain", "setuid"])
def test_unknown_backend_names_are_errors(monkeypatch, value):
    monkeypatch.setenv("FLYSPEC_SANDBOX", value)
    for call in (sandbox_info, lambda: run_sandboxed("pass\n", **FAST)):
        with pytest.raises(SandboxUnavailable) as caught:
            call()
        message = str(caught.value)
        assert isinstance(caught.value, FlyspecError)
        assert "\n" not in message and f"FLYSPEC_SANDBOX={value!r}" in message
        for valid in sandbox.SANDBOX_VALUES:
            assert valid in message
    if value == "setuid":
        assert "removed" in message


def test_a_forced_backend_that_is_unavailable_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "_chosen", None)
    monkeypatch.setattr(sandbox, "_namespace_backend", lambda: (None, "unshare not found"))
    monkeypatch.setenv("FLYSPEC_SANDBOX", "namespaces")
    with pytest.raises(SandboxUnavailable, match="namespaces"):
        sandbox_info()
    if ROOT:  # auto for root needs namespaces: no silent fall back to running as root
        monkeypatch.delenv("FLYSPEC_SANDBOX")
        with pytest.raises(SandboxUnavailable, match=sandbox.ROOT_PLAIN_OPT_IN):
            sandbox_info()


@pytest.mark.skipif(not ROOT, reason="the root-only refusal")
def test_plain_as_root_needs_the_loud_opt_in(monkeypatch):
    monkeypatch.setenv("FLYSPEC_SANDBOX", "plain")
    with pytest.raises(SandboxUnavailable, match=sandbox.ROOT_PLAIN_OPT_IN):
        sandbox_info()
    monkeypatch.setenv("FLYSPEC_SANDBOX", sandbox.ROOT_PLAIN_OPT_IN)
    info = sandbox_info()
    assert info.backend == "plain" and any("UNSAFE" in note for note in info.notes)
    assert any("NO isolation" in guarantee for guarantee in info.guarantees)


@pytest.mark.skipif(not ROOT, reason="the namespaces backend is root's")
def test_root_gets_the_namespaces_backend_by_default(monkeypatch):
    monkeypatch.delenv("FLYSPEC_SANDBOX", raising=False)
    info = sandbox_info().as_dict()
    assert info["backend"] == "namespaces" and info["run_limits"]


def test_flyspec_eval_exits_2_with_one_line_for_a_bad_sandbox(monkeypatch, capsys, tmp_path):
    from flyspec.cli import main

    monkeypatch.setenv("MKL_CBWR", os.environ.get("MKL_CBWR", "AUTO"))
    monkeypatch.setenv("FLYSPEC_SANDBOX", "bogus")
    out = tmp_path / "out"
    missing = str(tmp_path / "no-model")  # were the check late, loading would fail, not run
    status = main(
        ["eval", "--task", "humaneval", "--target", missing, "--draft", missing]
        + ["--output", str(out), "--no-progress"]
    )
    error = capsys.readouterr().err.strip()
    assert status == 2
    assert error.count("\n") == 0 and error.startswith("flyspec: error: FLYSPEC_SANDBOX='bogus'")
    assert not out.exists()


# ----------------------------------------------------------------------- run-wide limits


@pytest.fixture(params=["cgroup", "watchdog"])
def limits_by(request, monkeypatch):
    """The default backend with per-run cgroups (where this machine allows them), or with the
    host's watchdog alone."""
    monkeypatch.delenv("FLYSPEC_SANDBOX", raising=False)
    monkeypatch.setattr(sandbox, "_chosen", None)
    if request.param == "watchdog":
        monkeypatch.setattr(run_limits, "cgroup_plan", lambda *args, **kwargs: None)
    elif run_limits.cgroup_plan() is None:
        pytest.skip("no writable cgroup here")
    info = sandbox_info()
    assert (info.run_limits == "watchdog") == (request.param == "watchdog")
    return request.param


# 16 children touch 1 MiB every 20 ms up to 120 MiB each (1.9 GiB in all if nothing stopped
# them), then the parent waits for them and ends normally.
FORK_AND_ALLOCATE = """
import os, time
children = []
for _ in range(16):
    pid = os.fork()
    if pid == 0:
        held = []
        for _ in range(120):
            held.append(b"x" * (1 << 20))
            time.sleep(0.02)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_fork_and_allocate_cannot_exceed_the_run_budget(limits_by):
    result = run_sandboxed(FORK_AND_ALLOCATE, timeout_s=20.0, memory_mb=512)
    assert not result.passed and result.status == "killed", result
    assert "memory budget of 512 MiB" in result.detail
    assert result.peak_memory_mb is not None
    # the kernel holds a cgroup to its limit exactly; the watchdog may overshoot by a poll
    assert result.peak_memory_mb <= (512 if limits_by == "cgroup" else 768)


def test_forks_past_the_run_process_budget_fail(limits_by):
    program = (
        "import os, time\n"
        "for _ in range(20):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(10)\n"
        "        os._exit(0)\n"
    )
    result = run_sandboxed(program, timeout_s=10.0, memory_mb=512, max_processes=6)
    assert not result.passed and result.status in ("error", "killed"), result
    if limits_by == "cgroup":
        assert "limit of 6 processes" in result.detail


@pytest.mark.skipif(not ROOT, reason="needs root to start processes as nobody")
def test_other_nobody_processes_do_not_use_up_the_run_process_budget(limits_by):
    sleepers = [
        subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + ["sleep", "60"]
        )
        for _ in range(12)
    ]
    try:
        program = (
            "import os, time\n"
            "children = []\n"
            "for _ in range(5):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        time.sleep(0.2)\n"
            "        os._exit(0)\n"
            "    children.append(pid)\n"
            "for pid in children:\n"
            "    assert os.waitpid(pid, 0)[1] == 0\n"
        )
        result = run_sandboxed(program, timeout_s=10.0, memory_mb=512, max_processes=8)
        assert result.passed, result
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def test_runs_leave_no_cgroups_behind(monkeypatch):
    monkeypatch.delenv("FLYSPEC_SANDBOX", raising=False)
    plan = run_limits.cgroup_plan()
    if plan is None:
        pytest.skip("no writable cgroup here")
    assert run_sandboxed("print('hi')\n", **FAST).passed
    mine = f"{run_limits.CGROUP_PREFIX}{os.getpid()}-"
    for folder in (plan.memory, plan.pids):
        if folder is not None:
            assert not [p for p in folder.iterdir() if p.name.startswith(mine)]


def _fake_cgroup_files(tmp_path: Path, proc_cgroup: str, mounts: list[str]) -> tuple[Path, Path]:
    cgroup_file, mountinfo = tmp_path / "cgroup", tmp_path / "mountinfo"
    cgroup_file.write_text(proc_cgroup)
    mountinfo.write_text("".join(f"{30 + i} 23 0:{26 + i} {m}\n" for i, m in enumerate(mounts)))
    return cgroup_file, mountinfo


def test_cgroup_v2_run_cgroups_are_made_beside_a_cgroup_that_holds_processes(tmp_path):
    root = tmp_path / "fs"
    own = root / "user.slice" / "session.scope"
    own.mkdir(parents=True)
    (root / "user.slice" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text(f"1\n{os.getpid()}\n")
    files = _fake_cgroup_files(
        tmp_path, "0::/user.slice/session.scope\n", [f"/ {root} rw - cgroup2 cgroup2 rw"]
    )
    plan = run_limits.cgroup_plan(*files)
    assert plan == run_limits.CgroupPlan(2, root / "user.slice", root / "user.slice")
    run = run_limits.RunCgroup(plan, memory_mb=256, max_processes=4)
    assert run.memory == run.pids and run.memory.parent == root / "user.slice"
    assert (run.memory / "memory.max").read_text() == f"{256 << 20}\n"
    assert (run.memory / "pids.max").read_text() == f"{4 + run_limits.OVERHEAD_PROCESSES}\n"
    assert (run.memory / "memory.oom.group").read_text() == "1\n"
    assert run.procs_files() == [str(run.memory / "cgroup.procs")]
    (run.memory / "memory.events").write_text("low 0\nmax 3\noom 1\noom_kill 1\n")
    assert run.oom_kills() == 1


def test_cgroup_v1_hierarchies_and_no_cgroup_at_all(tmp_path):
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    (memory / "box").mkdir(parents=True)
    pids.mkdir()
    for folder in (memory / "box", pids):
        (folder / "cgroup.procs").write_text(f"{os.getpid()}\n")
    files = _fake_cgroup_files(
        tmp_path,
        "9:name=systemd:/\n8:pids:/\n4:memory:/box\n0::/\n",
        [
            f"/ {memory} rw - cgroup cgroup rw,memory",
            f"/ {pids} rw - cgroup cgroup rw,pids",
            f"/ {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw",
        ],
    )
    plan = run_limits.cgroup_plan(*files)
    assert plan == run_limits.CgroupPlan(1, memory / "box", pids)
    run = run_limits.RunCgroup(plan, memory_mb=128, max_processes=3)
    assert (run.memory / "memory.limit_in_bytes").read_text() == f"{128 << 20}\n"
    assert len(run.procs_files()) == 2
    (pids / "box").mkdir()  # a v2 mount without controllers and a foreign path: nothing
    files = _fake_cgroup_files(tmp_path, "0::/box\n", [f"/ {pids} rw - cgroup2 cgroup2 rw"])
    assert run_limits.cgroup_plan(*files) is None


# ------------------------------------------------------------------------ containment


def _survivors(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def test_a_double_forked_setsid_child_dies_with_the_run(backend):
    marker = f"{secrets.randbelow(10**6) + 10**6}.25"
    sleep = shutil.which("sleep", path="/usr/bin:/bin")
    program = f"""
import os
done, signal_write = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv({sleep!r}, ["sleep", {marker!r}])
    os._exit(0)
os.wait()
os.close(signal_write)
os.read(done, 1)  # returns once the grandchild's exec closed its copy of the pipe
"""
    try:
        assert run_sandboxed(program, **FAST).passed
        assert _survivors(marker) == []
    finally:
        for pid in _survivors(marker):
            os.kill(pid, 9)


@pytest.mark.skipif(not ROOT, reason="the namespaces backend is root's")
def test_no_loopback_from_inside_even_without_the_socket_module(monkeypatch):
    monkeypatch.delenv("FLYSPEC_SANDBOX", raising=False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"""
import ctypes, struct
def connect():
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    if fd < 0:
        return "no socket"
    address = struct.pack("<H", 2) + struct.pack(">H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
    return "connected" if libc.connect(fd, address, 16) == 0 else "refused"
"""
        tests = "def check(candidate):\n    assert candidate() != 'connected'\n"
        assert run_sandboxed(code, check=Check(tests, "connect"), **FAST).passed
        with pytest.raises(BlockingIOError):
            listener.accept()


# --------------------------------------------------------------- plain backend, non-root

# Run by the interpreter nobody may use, as nobody: the plain backend as a real non-root user
# (the program and its supervisor share the uid).
AS_NOBODY = """
import json, sys
sys.path.insert(0, sys.argv[1])
from flyspec.evaluation.sandbox import Check, run_sandboxed, sandbox_info
cases = json.loads(sys.stdin.read())
print(json.dumps({
    "backend": sandbox_info().backend,
    "results": {
        name: run_sandboxed(
            code, check=Check(tests, "below"), timeout_s=5.0, memory_mb=512
        ).status
        for name, (code, tests) in cases.items()
    },
}))
"""


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root, setpriv")
def test_plain_backend_as_a_real_non_root_user(tmp_path):
    interpreter = sandbox._interpreter_for_nobody()
    if interpreter is None:
        pytest.skip("no interpreter nobody may run")
    kill_supervisor = FORGE + "    forge([])\n    os.kill(os.getppid(), 9)\n    return []\n"
    names = ["frame nonce", "program file and /proc fds", "builtins patch"]
    bodies = {name: FAKES[name] for name in names}
    bodies["kill the supervisor"] = kill_supervisor
    cases = {name: (PROMPT + body, TESTS) for name, body in bodies.items()}
    cases["correct"] = (PROMPT + CORRECT, TESTS)
    tmp_path.chmod(0o755)
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", interpreter, "-I"]
        + ["-c", AS_NOBODY, str(SRC)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["backend"] == "plain"
    results = report["results"]
    assert results.pop("correct") == "passed"
    assert all(status != "passed" for status in results.values()), results


def test_result_fields_keep_their_order_for_callers():
    result = sandbox.SandboxResult(False, "error", "x")
    assert (result.passed, result.status, result.detail, result.seconds) == (
        False,
        "error",
        "x",
        0.0,
    )
    assert result.peak_memory_mb is None
    assert sys.modules["flyspec.evaluation.sandbox"] is sandbox
