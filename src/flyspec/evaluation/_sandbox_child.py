"""The half of :mod:`flyspec.evaluation.sandbox` that runs inside the sandbox.

Standard library only, and run from its source text as ``python -I -c SOURCE ROLE ARGS``: the
interpreter inside the sandbox need not have flyspec installed. Two roles, two processes:

``supervise SETTINGS`` (trusted code only)
    Reads the run (program, optional trusted check) from standard input, makes itself
    non-dumpable (so a process of the same uid can neither ptrace it, nor read its memory,
    nor open its file descriptors through ``/proc``) and a child subreaper, applies the resource
    limits and starts the candidate process. It then either relays the program's own result
    (a bare program) or runs the trusted tests itself, calling the program's function through
    pipes, and writes the verdict to the inherited verdict descriptor, which the candidate
    process never holds.
``candidate IN OUT`` (runs the untrusted program)
    A fresh interpreter that holds nothing but its two pipe ends: it runs the program, then
    answers calls of its function with plain values.

Values cross the pipes as tagged JSON built from ``None``, ``bool``, ``int``, ``float``,
``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set`` and ``frozenset``
only: the supervisor rebuilds fresh builtin objects, so nothing the program defines (an
``__eq__`` that is always true, a patched builtin) ever reaches the tests.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import signal
import sys
import time

MAX_FRAME = 32 << 20  # bytes of one message on a pipe
MAX_DEPTH = 200  # nesting of one value
DETAIL_CHARS = 2000
TRACE_LINES = 12
OUR_FILE = "<string>"  # frames of this source (run by -c) are left out of tracebacks


class Unencodable(Exception):
    """A value that is not plain data."""


class ProtocolError(Exception):
    """A message that breaks the call protocol."""


class ProgramEnded(BaseException):
    """The candidate process is gone or broke the protocol; the run cannot pass.

    A ``BaseException``, so that ``except Exception`` in the tests cannot swallow it."""

    def __init__(self, result: dict) -> None:
        super().__init__(result["detail"])
        self.result = result


# ----------------------------------------------------------------------------- plain values


def encode(value, depth: int = 0):
    """``value`` as tagged JSON data; raises :class:`Unencodable` for anything else."""
    if depth > MAX_DEPTH:
        raise Unencodable("a value nested too deeply")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return ["i", format(int.__index__(value), "x")]
    if isinstance(value, float):
        return ["f", float.hex(value)]
    if isinstance(value, complex):
        return ["c", float.hex(value.real), float.hex(value.imag)]
    if isinstance(value, (bytes, bytearray)):
        return ["b", bytes(value).hex()]
    inner = depth + 1
    if isinstance(value, list):
        return ["l", [encode(item, inner) for item in list.__iter__(value)]]
    if isinstance(value, tuple):
        return ["t", [encode(item, inner) for item in tuple.__iter__(value)]]
    if isinstance(value, frozenset):
        return ["fs", [encode(item, inner) for item in frozenset.__iter__(value)]]
    if isinstance(value, set):
        return ["s", [encode(item, inner) for item in set.__iter__(value)]]
    if isinstance(value, dict):
        items = dict.items(value)
        return ["d", [[encode(k, inner), encode(v, inner)] for k, v in items]]
    import numbers

    if isinstance(value, numbers.Integral):
        return encode(int(value), depth)
    if isinstance(value, numbers.Real):
        return encode(float(value), depth)
    if isinstance(value, numbers.Complex):
        return encode(complex(value), depth)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return encode(value.item(), inner)
    raise Unencodable(f"a {type(value).__name__}")


_SCALARS = {"i": lambda s: int(s, 16), "f": float.fromhex, "b": bytes.fromhex}
_GROUPS = {"l": list, "t": tuple, "s": set, "fs": frozenset}


def decode(data, depth: int = 0):
    """Fresh builtin objects from :func:`encode`'s output; :class:`ProtocolError` otherwise."""
    if data is None or data is True or data is False or type(data) is str:
        return data
    if depth > MAX_DEPTH:
        raise ProtocolError("a value nested too deeply")
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ProtocolError(f"not an encoded value: {type(data).__name__}")
    tag, rest = data[0], data[1:]
    try:
        if tag in _SCALARS and len(rest) == 1 and type(rest[0]) is str:
            return _SCALARS[tag](rest[0])
        if tag == "c" and len(rest) == 2 and all(type(part) is str for part in rest):
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if len(rest) != 1 or type(rest[0]) is not list:
            raise ProtocolError(f"bad encoded value with tag {tag!r}")
        if tag in _GROUPS:
            return _GROUPS[tag](decode(item, depth + 1) for item in rest[0])
        if tag == "d":
            result = {}
            for pair in rest[0]:
                if type(pair) is not list or len(pair) != 2:
                    raise ProtocolError("bad dictionary item")
                result[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return result
    except (ValueError, TypeError, OverflowError) as error:
        raise ProtocolError(f"bad encoded value: {error}") from None
    raise ProtocolError(f"unknown value tag {tag!r}")


# ------------------------------------------------------------------------------ messages


def send(fd: int, message: dict) -> None:
    """One newline-terminated JSON message, written whole."""
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8", "surrogatepass")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def receive(reader) -> dict | None:
    """The next message, or None at the end of the stream; ProtocolError for garbage."""
    line = reader.readline(MAX_FRAME + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) > MAX_FRAME:
            raise ProtocolError("a message over the size limit")
        return None  # cut off by the end of the stream
    try:
        message = json.loads(line.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        raise ProtocolError("a message that is not JSON") from None
    if type(message) is not dict:
        raise ProtocolError("a message that is not an object")
    return message


def describe(error: BaseException) -> str:
    """The last lines of ``error``'s traceback, without this file's frames."""
    import traceback

    try:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != OUR_FILE]
        lines = ["Traceback (most recent call last):\n"] if frames else []
        lines += traceback.format_list(frames)
        lines += traceback.format_exception_only(type(error), error)
        text = "".join("".join(lines).splitlines(True)[-TRACE_LINES:])
    except BaseException:
        text = type(error).__name__ + "\n"
    program_trace = getattr(error, "flyspec_program_trace", "")
    if program_trace:
        text += "raised in the program:\n" + program_trace
    return text


def _exit_text(code) -> str:
    try:
        return repr(code)[:200]
    except BaseException:
        return "?"


# ------------------------------------------------------------------------------ candidate


def serve(request_fd: int, reply_fd: int) -> None:
    """Run the untrusted program, then answer calls of its function until the pipe closes."""

    def refuse_network(event, args):
        if event == "socket.__new__":
            raise PermissionError("network access is disabled in the flyspec sandbox")

    sys.addaudithook(refuse_network)
    import linecache

    reader = os.fdopen(request_fd, "rb")
    first = receive(reader) or {}
    code = first.get("code", "")
    entry_point = first.get("entry_point")
    filename = "<program>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    pid = os.getpid()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    status, detail = "passed", ""
    try:
        exec(compile(code, filename, "exec"), namespace)
    except AssertionError as error:
        status, detail = "failed", describe(error)
    except SystemExit as stop:
        status = "error"
        detail = f"the program called exit({_exit_text(stop.code)}) before it finished"
    except BaseException as error:
        status, detail = "error", describe(error)
    _settle(pid)
    if entry_point is None or status != "passed":
        send(reply_fd, {"status": status, "detail": detail[-DETAIL_CHARS:]})
        os._exit(0)
    function = namespace.get(entry_point)
    if not callable(function):
        detail = f"the program defines no function {entry_point}()"
        send(reply_fd, {"status": "error", "detail": detail})
        os._exit(0)
    send(reply_fd, {"ready": True})
    while True:
        request = receive(reader)
        if request is None:
            os._exit(0)
        args = decode(request.get("args", ["l", []]))
        kwargs = decode(request.get("kwargs", ["d", []]))
        try:
            value = function(*args, **kwargs)
        except SystemExit as stop:
            reply = {"exit": _exit_text(stop.code)}
        except BaseException as error:
            reply = _raised(error)
        else:
            try:
                reply = {"return": encode(value)}
            except BaseException as error:
                reply = {
                    "raise": "TypeError",
                    "message": f"the function returned {error}, which cannot leave the sandbox "
                    "(plain data only: None, bool, numbers, str, bytes, list, tuple, dict, set)",
                }
        _settle(pid)
        send(reply_fd, reply)


def _raised(error: BaseException) -> dict:
    try:
        message = str(error)[:500]
    except BaseException:
        message = ""
    return {"raise": type(error).__name__, "message": message, "trace": describe(error)}


def _settle(pid: int) -> None:
    """A forked child of the program never talks for it; flush what the program printed."""
    if os.getpid() != pid:
        os._exit(1)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


# ----------------------------------------------------------------------------- supervisor


def supervise(settings: dict) -> None:
    """Run the program in a candidate process and write the verdict; never returns."""
    verdict_fd = settings["verdict_fd"]
    try:
        _protect_self()
        payload = json.loads(_take_stdin().decode("utf-8", "surrogatepass"))
        _apply_limits(settings["limits"])
        result = _run(payload)
    except BaseException as error:
        result = {"status": "error", "detail": f"sandbox supervisor failure: {error!r}"}
    try:
        send(verdict_fd, {**result, "detail": result.get("detail", "")[-DETAIL_CHARS:]})
    finally:
        _end_descendants()
        os._exit(0)


def _protect_self() -> None:
    """Non-dumpable (no ptrace, no /proc/<pid>/{mem,fd} for the same uid), child subreaper
    (orphans of the program stay below us), default SIGINT (no KeyboardInterrupt from it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable, pr_set_child_subreaper = 4, 36
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _take_stdin() -> bytes:
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return b"".join(chunks)


def _apply_limits(limits: dict) -> None:
    import resource

    for name, (soft, hard) in limits.items():
        kind = getattr(resource, name)
        _, old_hard = resource.getrlimit(kind)
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
            soft = min(soft, hard)
        resource.setrlimit(kind, (soft, hard))


class Candidate:
    """The candidate process and the two pipes to it."""

    def __init__(self, source: str) -> None:
        import subprocess

        request_read, self.request_fd = os.pipe()
        self.reply_fd, reply_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-c", source, "candidate", str(request_read), str(reply_write)],
            stdin=subprocess.DEVNULL,
            pass_fds=(request_read, reply_write),
            close_fds=True,
        )
        os.close(request_read)
        os.close(reply_write)
        self.reader = os.fdopen(self.reply_fd, "rb")
        self.ended: dict | None = None

    def send(self, message: dict) -> None:
        try:
            send(self.request_fd, message)
        except OSError:
            self._end(None)

    def receive(self) -> dict | None:
        """The candidate's next message; None (and ``ended`` set) when it is gone."""
        try:
            message = receive(self.reader)
        except (ProtocolError, OSError) as error:
            self._end(f"the program broke the sandbox's call protocol ({error})")
            return None
        if message is None:
            self._end(None)
        return message

    def _end(self, why: str | None) -> None:
        if self.ended is not None:
            return
        if why is not None:
            self.ended = {"status": "error", "detail": why}
            return
        try:
            returncode = self.process.wait()
        except BaseException:
            returncode = -9
        self.ended = _ended(returncode)

    def call(self, name: str, args: tuple, kwargs: dict):
        """The program's ``name(*args, **kwargs)``, as fresh plain values."""
        if self.ended is None:
            try:
                request = {"args": encode(list(args)), "kwargs": encode(dict(kwargs))}
            except Unencodable as error:
                raise TypeError(f"the tests pass {error} to {name}(): not plain data") from None
            self.send(request)
        reply = self.receive() if self.ended is None else None
        if reply is None:
            raise ProgramEnded(_during(self.ended, name))
        try:
            if "return" in reply:
                return decode(reply["return"])
            if "raise" in reply:
                raise_rebuilt(reply)
            if "exit" in reply:
                self.ended = {
                    "status": "error",
                    "detail": f"the program called exit({reply['exit']}) in {name}()",
                }
                raise ProgramEnded(self.ended)
            raise ProtocolError("an unknown reply")
        except ProtocolError as error:
            self.ended = {"status": "error", "detail": f"the program broke the protocol: {error}"}
            raise ProgramEnded(self.ended) from None

    def stop(self) -> None:
        try:
            self.process.kill()
            self.process.wait()
        except BaseException:
            pass


def raise_rebuilt(reply: dict) -> None:
    """Raise, in the tests, a fresh builtin exception like the one the program raised."""
    name, message, trace = reply.get("raise"), reply.get("message"), reply.get("trace")
    if type(name) is not str or type(message) is not str:
        raise ProtocolError("a bad exception reply")
    kind = getattr(builtins, name, None) if name.isidentifier() else None
    error: BaseException
    try:
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            raise TypeError
        error = kind(message)
    except BaseException:
        error = RuntimeError(f"{name}: {message}")
    error.flyspec_program_trace = trace[-DETAIL_CHARS:] if type(trace) is str else ""
    raise error


def _ended(returncode: int) -> dict:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {"SIGKILL": " (out of memory or killed)", "SIGXCPU": " (CPU-time limit)"}
        return {"status": "killed", "detail": f"killed by {name}{hint.get(name, '')}", "tail": 1}
    return {
        "status": "error",
        "detail": f"the program ended (status {returncode}) without reporting a result",
        "tail": 1,
    }


def _during(ended: dict, name: str) -> dict:
    detail = ended["detail"].replace("without reporting a result", f"during a call of {name}()")
    return {**ended, "detail": detail}


def _run(payload: dict) -> dict:
    check = payload.get("check")
    candidate = Candidate(payload["source"])
    try:
        entry_point = check["entry_point"] if check else None
        candidate.send({"code": payload["code"], "entry_point": entry_point})
        first = candidate.receive()
        if first is None:
            return candidate.ended
        status = first.get("status")
        if check is None:  # a bare program: its own report is all there is
            if status in ("passed", "failed", "error"):
                return {"status": status, "detail": str(first.get("detail", ""))}
            return {"status": "error", "detail": "the program sent a malformed result"}
        if first.get("ready") is not True:
            if status in ("failed", "error"):  # the program may only claim to fail
                return {"status": status, "detail": str(first.get("detail", ""))}
            return {"status": "error", "detail": "the program sent a malformed result"}
        return _check(candidate, check)
    finally:
        candidate.stop()


def _check(candidate: Candidate, check: dict) -> dict:
    """Run the trusted tests here, calling the program's function in the candidate process."""
    import linecache

    entry_point = check["entry_point"]
    namespace = {"__name__": "__flyspec_check__", "__builtins__": builtins}
    for filename, text in (("<prelude>", check.get("prelude", "")), ("<tests>", check["tests"])):
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        try:
            exec(compile(text, filename, "exec"), namespace)
        except BaseException as error:
            what = "prelude" if filename == "<prelude>" else "tests"
            return {"status": "error", "detail": f"the {what} failed to load:\n{describe(error)}"}

    def proxy(*args, **kwargs):
        return candidate.call(entry_point, args, kwargs)

    proxy.__name__ = proxy.__qualname__ = entry_point
    namespace[entry_point] = proxy
    function = namespace.get(check.get("function", "check"))
    if not callable(function):
        return {"status": "error", "detail": "the tests define no check function"}
    try:
        function(proxy)
    except AssertionError as error:
        return {"status": "failed", "detail": describe(error)}
    except ProgramEnded as ended:
        return ended.result
    except BaseException as error:
        return {"status": "error", "detail": describe(error)}
    if candidate.ended is not None:  # the tests swallowed the end of the program
        return candidate.ended
    return {"status": "passed", "detail": ""}


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
    except OSError:
        pass
    return found


def _end_descendants() -> None:
    """SIGKILL every process below this one (orphans come to us: we are a subreaper)."""
    me = os.getpid()
    for _ in range(50):
        pending, seen = [me], []
        while pending:
            for child in _children(pending.pop()):
                seen.append(child)
                pending.append(child)
        if not seen:
            break
        for pid in seen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                return
        time.sleep(0.002)


if __name__ == "__main__":
    if sys.argv[1:2] == ["supervise"]:
        supervise(json.loads(sys.argv[2]))
    elif sys.argv[1:2] == ["candidate"]:
        serve(int(sys.argv[2]), int(sys.argv[3]))
