"""``flyspec serve`` and llama.cpp's ``llama-server`` as child processes, for the benchmarks
that measure them over HTTP: on a free port, waited for until ``/health`` answers, and always
stopped."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from flyspec.bench.llama_server import ServerSetup, llama_server_binary, server_arguments
from flyspec.config import LlamaCppConfig
from flyspec.models.default_pair import default_gguf_paths
from flyspec.models.llamacpp import default_threads
from flyspec.support.child_server import running


@contextmanager
def serving(arguments: Sequence[str], *, start_seconds: float = 600) -> Iterator[str]:
    """``flyspec serve ARGUMENTS`` (this Python's flyspec, started as its console script starts
    it: ``python -m flyspec``) on a free port: its URL once it answers ``/health``;
    FlyspecError with its last line where it exits first or does not answer within
    ``start_seconds``."""

    def command(port: int) -> list[str]:
        serve = [sys.executable, "-m", "flyspec", "serve", "--port", str(port)]
        return [*serve, "--log-level", "warning", *arguments]

    with running("flyspec serve", command, start_seconds=start_seconds) as url:
        yield url


@contextmanager
def llama_serving(extra: Sequence[str] = (), *, start_seconds: float = 300) -> Iterator[str]:
    """llama-server on the default target's GGUF file, with the threads and context of
    flyspec's llama.cpp backend (as the bench's ``llama-server`` runs), and ``extra``
    options: its URL once it answers."""
    setup = ServerSetup(
        target=default_gguf_paths().target,
        threads=default_threads(),
        context=LlamaCppConfig().context,
    )
    arguments = [llama_server_binary(), *server_arguments("llama-server", setup, k=1), *extra]
    with running(
        "llama-server",
        lambda port: [*arguments, "--port", str(port)],
        start_seconds=start_seconds,
    ) as url:
        yield url
