"""llama.cpp's own server, ``llama-server``, as a peer in ``flyspec bench``: what a CPU user who
wants a fast local model runs.

Each method starts the server as a child process on a free port, on the pair's GGUF files with
the threads, context and batch of flyspec's llama.cpp engine, and sends every prompt as token
ids (the chat template already applied, so every method reads the same tokens) to its
``/completion`` endpoint, with the prompt cache off, so every prompt is read in full as in the
other methods:

- ``llama-server``: plain decoding;
- ``llama-server-ngram-mod``: its speculation from n-grams of the context (``--spec-type
  ngram-mod``), with its own defaults: a 24-token match, drafts of 48 to 64 tokens;
- ``llama-server-ngram-simple``: ``--spec-type ngram-simple``, drafts of up to K tokens;
- ``llama-server-draft``: the draft GGUF drafting (``--spec-type draft-simple
  --spec-draft-model``), up to K tokens.

K is the method's ``@K`` or ``-k`` (:func:`flyspec.bench.methods.make_method` reads it).
The binary is ``$FLYSPEC_LLAMA_SERVER``, else the one ``scripts/setup.sh --llamacpp`` links
beside this Python, else ``llama-server`` on the PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from flyspec.bench.sample_run import SampleRun
from flyspec.config import SamplingConfig
from flyspec.errors import FlyspecError
from flyspec.support.child_server import ChildServer
from flyspec.support.huge_pages import started_environment

# name -> --spec-type, or None: plain decoding.
LLAMA_SERVER_METHODS: dict[str, str | None] = {
    "llama-server": None,
    "llama-server-ngram-mod": "ngram-mod",
    "llama-server-ngram-simple": "ngram-simple",
    "llama-server-draft": "draft-simple",
}
LLAMA_SERVER_SIZED = frozenset({"llama-server-ngram-simple", "llama-server-draft"})
"""The methods whose largest draft is K (``@K`` or ``-k``); ngram-mod sizes its own."""
START_SECONDS = 300


def llama_server_binary() -> str:
    """The llama-server to run; FlyspecError that says how to get one where there is none."""
    chosen = os.environ.get("FLYSPEC_LLAMA_SERVER")
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise FlyspecError(f"FLYSPEC_LLAMA_SERVER={chosen} is not an executable file")
        return chosen
    beside_python = Path(sys.executable).parent / "llama-server"
    if os.access(beside_python, os.X_OK):
        return str(beside_python)
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    raise FlyspecError(
        "llama-server was not found: `bash scripts/setup.sh --llamacpp` builds it from the "
        "binding's llama.cpp (about 5 minutes), or set FLYSPEC_LLAMA_SERVER to a llama-server"
    )


@dataclass(frozen=True)
class ServerSetup:
    """What a llama-server runs on, as flyspec's llama.cpp engine does: the GGUF files (the
    draft's None where there is none), threads, context and batch."""

    target: str | Path
    draft: str | Path | None = None
    threads: int = 1
    context: int = 8192
    batch: int = 512

    @classmethod
    def of_engine(cls, engine) -> ServerSetup:
        """The setup of a llama.cpp :class:`~flyspec.engine.Engine`."""
        target, draft = engine.decoder.target, engine.decoder.draft
        return cls(
            target=target.path,
            draft=None if draft is None else draft.path,
            threads=target.threads,
            context=target.context_length,
            batch=target.runner.batch_size,
        )


def server_arguments(name: str, setup: ServerSetup, *, k: int) -> list[str]:
    """llama-server's command-line options for the method ``name`` (port excepted)."""
    spec_type = LLAMA_SERVER_METHODS[name]
    threads, batch = str(setup.threads), str(setup.batch)
    arguments = ["--model", str(setup.target), "--host", "127.0.0.1"]
    arguments += [
        "--ctx-size",
        str(setup.context),
        "--threads",
        threads,
        "--threads-batch",
        threads,
    ]
    arguments += ["--batch-size", batch, "--ubatch-size", batch, "--parallel", "1"]
    arguments += ["--no-webui"]
    if spec_type == "draft-simple":
        if setup.draft is None:
            raise FlyspecError(f"method {name} needs the draft model's GGUF file")
        arguments += ["--spec-draft-model", str(setup.draft), "--spec-draft-threads", threads]
    if spec_type is not None:
        arguments += ["--spec-type", spec_type]
    if name in LLAMA_SERVER_SIZED:
        arguments += ["--spec-draft-n-max", str(k)]
    return arguments


class LlamaServerMethod:
    """One llama-server setting of a benchmark: the server runs from :meth:`start` to
    :meth:`close`; each :meth:`run` is one ``/completion`` request, timed end to end, its
    prompt time taken from the server's own ``timings``."""

    def __init__(
        self,
        name: str,
        setup: ServerSetup,
        *,
        k: int,
        eos_token_ids: Collection[int],
        sampling: SamplingConfig,
    ) -> None:
        base = name.partition("@")[0]  # a method's name may end in @K
        self.name = name
        self.sampling = sampling
        self.eos_token_ids = frozenset(eos_token_ids)
        self.binary = llama_server_binary()
        arguments = server_arguments(base, setup, k=k)
        self.server = ChildServer(
            name,
            lambda port: [self.binary, *arguments, "--port", str(port)],
            start_seconds=START_SECONDS,
            environment=started_environment(),  # as its users run it: no restart's tunable
        )
        self.settings = {
            "engine": "llama-server",
            "threads": setup.threads,
            "context": setup.context,
        }
        spec_type = LLAMA_SERVER_METHODS[base]
        if spec_type is not None:
            self.settings["spec_type"] = spec_type
        if base in LLAMA_SERVER_SIZED:
            self.settings["k"] = k

    def start(self) -> LlamaServerMethod:
        self.server.start()
        return self

    def close(self) -> None:
        self.server.stop()

    def request(self, body: dict, *, timeout: float = 3600) -> dict:
        """POST ``body`` to ``/completion``: the server's answer; FlyspecError with the
        server's message where it refuses or has stopped."""
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.server.url + "/completion",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise FlyspecError(f"{self.name} answered {error.code}: {detail}") from error
        except OSError as error:
            raise FlyspecError(
                f"{self.name} did not answer ({error}): {self.server.last_output()}"
            ) from error

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        sampling = self.sampling
        body = {
            "prompt": [int(token) for token in prompt_ids],
            "n_predict": max_new_tokens,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            "temperature": sampling.temperature if not sampling.greedy else 0.0,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "seed": seed if seed is not None else 0,
        }
        started = time.perf_counter()
        answer = self.request(body)
        seconds = time.perf_counter() - started
        tokens = []
        for token in answer.get("tokens") or []:
            if token in self.eos_token_ids:
                break
            tokens.append(int(token))
        timings = answer.get("timings") or {}
        prompt_ms = timings.get("prompt_ms")
        return SampleRun(
            tokens[:max_new_tokens],
            seconds,
            prefill_seconds=None if prompt_ms is None else prompt_ms / 1000,
            server_timings=timings,
        )
