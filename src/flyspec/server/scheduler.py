"""One generation at a time: a bounded waiting line in front of the engine.

The engine is not thread-safe, so a single worker coroutine takes jobs in arrival order and
runs each one to its end on a single dedicated thread (the event loop stays free to accept
and stream). Requests that find the line full are refused at once by :meth:`submit`.

A job ends in one of these outcomes:

* ``stop`` / ``length``: the engine finished (EOS or a stop string / ``max_new_tokens``);
* ``timeout``: its deadline passed, while waiting (no tokens) or while running (the engine
  is stopped after the next committed token and releases the text it held back); the
  response reports ``finish_reason: "length"``, as for any truncated output;
* ``cancelled``: its client went away; a waiting job leaves the line at once, a running one
  stops after the next committed token (nothing after that point is computed);
* ``error``: the engine raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from flyspec.config import DecodeConfig
from flyspec.decoding.grammar import Grammar
from flyspec.decoding.logprobs import TokenLogprob
from flyspec.decoding.loop import Origin
from flyspec.decoding.stats import RequestStats

logger = logging.getLogger("flyspec.server")

JobOutcome = str  # "stop" | "length" | "timeout" | "cancelled" | "error"


class QueueFullError(Exception):
    """No room left in the waiting line."""


@dataclass(frozen=True)
class _End:
    """Sentinel put on a job's event queue when it has ended."""


@dataclass(frozen=True)
class TokenRecord:
    """An emitted token with its log-probability (a job that asked for them); or a token of
    an echoed prompt (``origin`` ``prompt``; its first has no log-probability)."""

    token: int
    origin: Origin | Literal["prompt"]
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class Piece:
    """Text released by the engine, and the records of the tokens emitted since the last
    piece (where the job asked for log-probabilities)."""

    text: str
    records: tuple[TokenRecord, ...] = ()


class Job:
    """One request's generation: its inputs, its text as it arrives, and how it ended.

    The consumer iterates :meth:`pieces` on the event loop; the engine thread feeds it through
    ``loop.call_soon_threadsafe``.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        deadline: float,
        prediction_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        echo: str | None = None,
        prompt_only: bool = False,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.logprobs = logprobs
        self.grammar = grammar
        self.echo = echo
        self.prompt_only = prompt_only
        self.prediction_ids = None if prediction_ids is None else list(prediction_ids)
        self.config = config
        self.deadline = deadline
        self.stats = RequestStats()
        self.state = "waiting"  # waiting -> running -> done
        self.outcome: JobOutcome | None = None
        self.error: BaseException | None = None
        self.completion_tokens = 0
        self.stop_requested: JobOutcome | None = None
        self._stop_event = threading.Event()
        self._events: asyncio.Queue[Piece | _End] = asyncio.Queue()
        self._deadline_timer: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def timed_out(self) -> bool:
        return self.outcome == "timeout"

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: ``stop``, or ``length`` (also after a timeout)."""
        if self.outcome in ("stop", "length"):
            return self.outcome
        if self.outcome == "timeout":
            return "length"
        return None

    async def pieces(self) -> AsyncIterator[Piece]:
        """The generated text, piece by piece, until the job ends."""
        while True:
            item = await self._events.get()
            if isinstance(item, _End):
                self._events.put_nowait(item)  # a second reader ends at once too
                return
            yield item

    async def wait(self) -> Piece:
        """The whole text and every token's record, once the job has ended."""
        pieces = [piece async for piece in self.pieces()]
        records = tuple(record for piece in pieces for record in piece.records)
        return Piece("".join(piece.text for piece in pieces), records)

    # Called from the engine thread.
    def _should_stop(self) -> bool:
        return self._stop_event.is_set()

    # Called on the event loop.
    def _request_stop(self, reason: JobOutcome) -> None:
        if self.stop_requested is None:
            self.stop_requested = reason
        self._stop_event.set()

    def _push(self, piece: Piece) -> None:
        self._events.put_nowait(piece)

    def _end(self, outcome: JobOutcome, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.state = "done"
        self.outcome = outcome
        self.error = error
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._events.put_nowait(_End())


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that runs torch in a serving process: load the models on it
    (``engine_thread().submit(load, ...).result()``) and give it to the queue.

    torch's CPU kernels run their parallel regions on an OpenMP team per calling thread.
    Once a second thread has used torch, the process holds more OpenMP threads than cores,
    and libgomp then stops its workers spinning between regions: every region pays a
    futex wake-up. ``benchmarks/torch_threads.py`` on 2 cores (the default pair, 64 tokens):
    5.51 s on the loading thread, 6.34 s on a second thread, 6.19 s on the first after it.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyspec-engine")


class GenerationQueue:
    """The waiting line plus the single worker that feeds the engine.

    ``max_waiting``: how many jobs may wait while one runs; one more is refused with
    :class:`QueueFullError`. ``on_finished(job)`` is called on the event loop when a job ends
    (metrics). ``executor``: the thread the engine runs on, best the one it was loaded on
    (:func:`engine_thread`); without one, the queue starts its own. Use :meth:`start` and
    :meth:`close` from the app's lifespan.
    """

    def __init__(
        self,
        engine,
        *,
        max_waiting: int,
        on_finished=None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finished = on_finished
        self._given_executor = executor
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        """Jobs in the line, not counting the running one."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    def start(self) -> None:
        """Start the worker on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._executor = self._given_executor or engine_thread()
        self._worker = self._loop.create_task(self._work(), name="flyspec-generation-worker")

    async def close(self) -> None:
        """Stop the worker: waiting jobs are cancelled, the running one is asked to stop."""
        for job in list(self._waiting):
            self.cancel(job)
        if self._running is not None:
            self._running._request_stop("cancelled")
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._executor is not None and self._executor is not self._given_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def submit(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        timeout: float,
        prediction_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        echo: str | None = None,
        prompt_only: bool = False,
    ) -> Job:
        """Put a job in line, or raise :class:`QueueFullError` when the line is full.
        ``echo``: a text its answer starts with (the prompt), with the prompt's
        log-probabilities where it asks for them; ``prompt_only``: nothing after it."""
        if self._loop is None or self._wakeup is None:
            raise RuntimeError("the generation queue is not started")
        if len(self._waiting) + self.running > self.max_waiting:
            raise QueueFullError
        job = Job(
            prompt_ids,
            config,
            deadline=time.monotonic() + timeout,
            prediction_ids=prediction_ids,
            logprobs=logprobs,
            grammar=grammar,
            echo=echo,
            prompt_only=prompt_only,
        )
        job._deadline_timer = self._loop.call_later(timeout, self._on_deadline, job)
        self._waiting.append(job)
        self._wakeup.set()
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone: drop a waiting job, stop a running one. Idempotent."""
        self._stop(job, "cancelled")

    def _on_deadline(self, job: Job) -> None:
        self._stop(job, "timeout")

    def _stop(self, job: Job, reason: JobOutcome) -> None:
        if job.done:
            return
        if job.state == "waiting":
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
            self._finish(job, reason)
        else:
            job._request_stop(reason)

    def _finish(self, job: Job, outcome: JobOutcome, error: BaseException | None = None) -> None:
        if job.done:
            return
        job._end(outcome, error)
        if self.on_finished is not None:
            try:
                self.on_finished(job)
            except Exception:  # metrics must never break serving
                logger.exception("on_finished failed")

    async def _work(self) -> None:
        assert self._wakeup is not None and self._loop is not None
        while True:
            while not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self._waiting.popleft()
            job.state = "running"
            self._running = job
            future = self._loop.run_in_executor(self._executor, self._generate, job, self._loop)
            try:
                outcome, error = await asyncio.shield(future)
            except asyncio.CancelledError:
                job._request_stop("cancelled")
                self._finish(job, "cancelled")
                self._running = None
                raise
            self._running = None
            self._finish(job, outcome, error)

    def _echo(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        """Hand over the echoed prompt, with its tokens' log-probabilities where asked."""
        records: tuple[TokenRecord, ...] = ()
        if job.logprobs is not None:
            values = self.engine.prompt_logprobs(job.prompt_ids, top=job.logprobs)
            records = tuple(
                TokenRecord(token, "prompt", value)
                for token, value in zip(job.prompt_ids, values, strict=True)
            )
        loop.call_soon_threadsafe(job._push, Piece(job.echo, records))

    def _generate(
        self, job: Job, loop: asyncio.AbstractEventLoop
    ) -> tuple[JobOutcome, BaseException | None]:
        """Run on the engine thread: iterate the engine, hand text to the loop, obey stops."""
        if job._should_stop():
            return job.stop_requested or "cancelled", None
        if job.echo is not None:
            try:
                self._echo(job, loop)
            except Exception as error:
                logger.exception("the prompt's log-probabilities failed")
                return "error", error
            if job.prompt_only:
                return "length", None
        # The engine ends the request after the next committed token once a stop is
        # requested, and still hands over the text it held back (a stop-string prefix).
        stream = self.engine.stream(
            job.prompt_ids,
            job.config,
            stats=job.stats,
            should_stop=job._should_stop,
            prediction=job.prediction_ids,
            logprobs=job.logprobs,
            grammar=job.grammar,
        )
        records: list[TokenRecord] = []  # of the tokens since the last piece handed over
        try:
            for chunk in stream:
                if chunk.token is not None:
                    job.completion_tokens += 1
                    if chunk.logprob is not None:
                        records.append(TokenRecord(chunk.token, chunk.origin, chunk.logprob))
                if chunk.text:
                    try:
                        loop.call_soon_threadsafe(job._push, Piece(chunk.text, tuple(records)))
                    except RuntimeError:  # the event loop is gone: the server is stopping
                        return "cancelled", None
                    records = []
            if job._should_stop():
                return job.stop_requested or "cancelled", None
        except Exception as error:
            logger.exception("generation failed")
            return "error", error
        finally:
            stream.close()
        reason = job.stats.finish_reason
        return (reason if reason in ("stop", "length") else "length"), None
