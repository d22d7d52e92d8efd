"""``flyspec serve`` and llama.cpp's ``llama-server`` as child processes, for the benchmarks
that measure them over HTTP: on a free port, waited for until ``/health`` answers, and always
stopped; and a pass of chat requests through either, timed end to end (:func:`timed_pass`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from flyspec.bench.llama_server import ServerSetup, llama_server_binary, server_arguments
from flyspec.bench.prompts import BenchPrompt
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


WARM_UP = ({"role": "user", "content": "Name three colours."},)


@dataclass(frozen=True)
class PassRun:
    """A pass of requests: completion tokens, seconds end to end, the seconds the server
    itself says it took (llama-server's ``timings``, flyspec's ``speculative.seconds``:
    reading the prompt and decoding) and the answers."""

    tokens: int
    seconds: float
    server_seconds: float
    answers: list[str]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def ask(
    client, model: str, messages, *, max_tokens: int, prediction: str = ""
) -> tuple[int, float, str]:
    """One greedy chat request: its completion tokens, the server's own seconds and the
    answer."""
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
    answer = client.chat.completions.create(
        model=model, messages=list(messages), max_tokens=max_tokens, temperature=0, **extra
    )
    reported = answer.model_extra or {}
    if "timings" in reported:
        server_seconds = (
            reported["timings"]["prompt_ms"] + reported["timings"]["predicted_ms"]
        ) / 1000
    else:
        server_seconds = reported["speculative"]["seconds"]
    return answer.usage.completion_tokens, server_seconds, answer.choices[0].message.content


def timed_pass(
    url: str,
    prompts: Sequence[BenchPrompt],
    *,
    max_tokens: int,
    predicted: bool = False,
    warm_up: bool = False,
) -> PassRun:
    """Each prompt's chat request to the server at ``url`` in turn, through the ``openai``
    client, each timed end to end: greedy, with the prompt's prediction where ``predicted``;
    first one short untimed request on another prompt where ``warm_up`` (so that a new
    server's first request does not pay for its start)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=900)
    model = client.models.list().data[0].id
    if warm_up:
        ask(client, model, WARM_UP, max_tokens=8)
    tokens, seconds, server_seconds, answers = 0, 0.0, 0.0, []
    for prompt in prompts:
        started = time.perf_counter()
        count, own, answer = ask(
            client,
            model,
            prompt.messages,
            max_tokens=max_tokens,
            prediction=prompt.prediction if predicted else "",
        )
        seconds += time.perf_counter() - started
        tokens += count
        server_seconds += own
        answers.append(answer)
    return PassRun(tokens, seconds, server_seconds, answers)
