"""``flyspec serve`` as a child process, for the benchmarks that measure it over HTTP: on a
free port, waited for until ``/health`` answers, and always stopped."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence


def free_port() -> int:
    """A port on the loopback address that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(arguments: Sequence[str], *, start_seconds: float = 600) -> Iterator[str]:
    """``flyspec serve ARGUMENTS`` (this Python's flyspec) on a free port: its URL once it
    answers ``/health``; RuntimeError with the end of its log where it exits first or does
    not answer within ``start_seconds``."""
    port = free_port()
    command = [sys.executable, "-m", "flyspec.cli", "serve", "--port", str(port)]
    command += ["--log-level", "warning", *arguments]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_seconds
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"flyspec serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"flyspec serve did not start within {start_seconds:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
