"""An HTTP server run as a child process on a free loopback port: started, waited for until its
health URL answers, and always stopped. ``flyspec bench`` runs llama-server this way, and the
benchmarks that measure ``flyspec serve`` over HTTP run it so."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence

from flyspec.errors import FlyspecError


def free_port() -> int:
    """A port on the loopback address that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ChildServer:
    """``command`` (built for a port by ``command_for_port``) running as a child process,
    its output kept in a temporary file for the reason of a failed start.

    :meth:`start` waits until ``GET {url}{health}`` answers 200, or raises FlyspecError with
    the last lines of the child's output, on one line, where it exits first or does not
    answer within ``start_seconds``; :meth:`stop` ends it (also on a failed start).
    ``environment``: the child's (None: this process's)."""

    def __init__(
        self,
        name: str,
        command_for_port: Callable[[int], Sequence[str]],
        *,
        health: str = "/health",
        start_seconds: float = 600,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.environment = None if environment is None else dict(environment)
        self.port = free_port()
        self.command = [str(part) for part in command_for_port(self.port)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.health = health
        self.start_seconds = start_seconds
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self) -> ChildServer:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (kept open until stop)
        try:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.environment,
            )
        except OSError as error:
            self.stop()
            raise FlyspecError(f"{self.name} could not start: {error}") from error
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.start_seconds
        while True:
            if self.process.poll() is not None:
                raise FlyspecError(
                    f"{self.name} exited with status {self.process.returncode} before it "
                    f"answered: {self.last_output(3) or 'it printed nothing'}"
                )
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or still loading (HTTPError 503)
                pass
            if time.monotonic() > deadline:
                raise FlyspecError(
                    f"{self.name} did not answer {self.health} within {self.start_seconds:.0f} s: "
                    f"{self.last_output(3) or 'it printed nothing'}"
                )
            time.sleep(0.2)

    def last_output(self, lines: int = 1) -> str:
        """The last ``lines`` non-empty lines the child printed, joined by " | "."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read()[-20000:].decode(errors="replace")
        return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])

    def stop(self) -> None:
        """Terminate the child (killed after 30 s) and drop its output; safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ChildServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextlib.contextmanager
def running(
    name: str, command_for_port: Callable[[int], Sequence[str]], **options
) -> Iterator[str]:
    """:class:`ChildServer` as a context: its URL while it runs."""
    with ChildServer(name, command_for_port, **options) as server:
        yield server.url
