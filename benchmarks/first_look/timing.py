"""How the phases time what runs on the device, with flyspec's one timer
(:mod:`flyspec.models.timing`).

A forward timed alone (``V(n)``, ``d``) takes its clock that waits for the device
(:func:`~flyspec.models.timing.device_clock`, in :func:`flyspec.bench.forward_cost.time_forwards`).
The forwards of a decode cannot: the loop's own time is the decode's wall time minus its
forwards' device time, and a wait around each forward would add host synchronisations, the
very thing the loop's rows count. So :class:`TimedRunner` marks each forward with a
:class:`~flyspec.models.timing.DeviceSpan` (CUDA events on a GPU, the clock on the CPU) and
reads them after the decode; a copy or an attention kernel timed alone (:func:`timed`) takes a
span as well, its device time without the launch's.

A decode's window (:class:`Window`) starts after its first round, so that neither the prompt's
prefill nor the first round's start-up counts.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats
from flyspec.models.cache import CachedLM, ForwardRunner, make_forward
from flyspec.models.timing import DeviceSpan, wait_for_device

SYNC_WARNING = "synchronizing CUDA operation"


def timed(device: torch.device, work: Callable[[], object]) -> float:
    """Seconds the device spends on ``work`` (a :class:`DeviceSpan`: CUDA events on a GPU, the
    clock on the CPU)."""
    with DeviceSpan(device) as span:
        work()
    return span.seconds()


class TimedRunner:
    """A :class:`~flyspec.models.cache.ForwardRunner` that times every forward of the runner
    it wraps with a :class:`DeviceSpan`: the device's time, no synchronisation added (CUDA
    events on a GPU; on the CPU, where a forward is done when it returns, the clock). Each
    record is the time the host issued the forward and its span."""

    def __init__(self, inner: ForwardRunner) -> None:
        self.inner = inner
        self.forward_path = inner.forward_path
        self.model = inner.model
        self.device = inner.device
        self.context_length = inner.context_length
        self.records: list[tuple[float, DeviceSpan]] = []

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def reset(self) -> None:
        self.inner.reset()

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def reserve(self, positions: int) -> None:
        self.inner.reserve(positions)

    def state_bytes(self) -> int:
        return self.inner.state_bytes()

    def forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Logits ``[num_logits, V]`` of the wrapped runner, the call recorded."""
        issued = time.perf_counter()
        with DeviceSpan(self.device) as span:
            logits = self.inner.forward(input_ids, num_logits)
        self.records.append((issued, span))
        return logits

    def device_seconds(self, since: float) -> float:
        """The forwards' device time, of those issued at ``since`` or later (after the device
        has finished them)."""
        return sum(span.seconds() for issued, span in self.records if issued >= since)


def timed_lm(model: torch.nn.Module, forward_path: str = "lean") -> tuple[CachedLM, TimedRunner]:
    """A :class:`CachedLM` over the forward ``forward_path`` of ``model`` (the decoder's
    default: lean), timed."""
    runner = TimedRunner(make_forward(model, forward_path))
    return CachedLM(runner), runner


@contextlib.contextmanager
def sync_counter(device: torch.device) -> Iterator[Callable[[], int] | None]:
    """Count host synchronisations on CUDA: torch reports each synchronising call (a copy to or
    from the host that waits for the device, ``.item()``, ``nonzero``...) as a warning in its
    sync debug mode. Yields a function reading the count so far; None on other devices."""
    if device.type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:

            def count() -> int:
                return sum(SYNC_WARNING in str(w.message) for w in caught)

            probe = torch.ones(1, device=device)
            probe.item()
            probe.item()  # two known synchronisations: is each one reported?
            seen = count()
            yield (lambda: count() - seen) if seen == 2 else None
        finally:
            torch.cuda.set_sync_debug_mode("default")


@dataclass(frozen=True)
class Window:
    """A decode from the end of its first round to its last token: wall seconds, the device
    seconds of the forwards issued in it, its rounds, tokens, drafted and kept tokens, the
    host synchronisations counted in it (None: not counted), and the ids of every token the
    decode gave, the first round's included."""

    seconds: float
    forward_seconds: float
    rounds: int
    tokens: int
    drafted: int
    kept: int
    syncs: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AfterFirstRound:
    """A request's tokens as they came: from the end of its first round (after the prompt's
    prefill and the first round's start-up) to its last token, the wall seconds, the tokens
    and the host synchronisations (None: not counted); the clock at its start; and the ids of
    every token, the first round's included."""

    started: float
    seconds: float
    tokens: int
    syncs: int | None
    token_ids: tuple[int, ...]


def after_first_round(
    events: Iterator, stats: RequestStats, syncs: Callable[[], int] | None = None
) -> AfterFirstRound:
    """Consume a request's ``events`` (``stats`` its statistics, filled as it runs), with
    ``syncs`` reading the host synchronisations so far where they are counted."""
    marks: list[tuple[int, float, int]] = []  # (rounds so far, time, syncs so far) per token
    token_ids: list[int] = []
    for event in events:
        marks.append((stats.num_rounds, time.perf_counter(), syncs() if syncs else 0))
        token_ids.append(event.token)
    first = max(i for i, (rounds, _, _) in enumerate(marks) if rounds == 1)
    return AfterFirstRound(
        started=marks[first][1],
        seconds=marks[-1][1] - marks[first][1],
        tokens=len(marks) - 1 - first,
        syncs=marks[-1][2] - marks[first][2] if syncs is not None else None,
        token_ids=tuple(token_ids),
    )


def decode_window(
    decoder: SpeculativeDecoder,
    runners: Sequence[TimedRunner],
    prompt: Sequence[int],
    config: DecodeConfig,
    *,
    count_syncs: bool = False,
) -> Window:
    """Run one greedy request and measure it after its first round (:class:`Window`); with
    ``count_syncs``, count its host synchronisations instead of timing it (CUDA only; None
    where torch does not report them)."""
    device = decoder.target.device
    stats = RequestStats()
    for runner in runners:
        runner.records.clear()
    with sync_counter(device if count_syncs else torch.device("cpu")) as syncs:
        run = after_first_round(decoder.stream(prompt, config, stats=stats), stats, syncs)
    wait_for_device(device)
    if run.tokens == 0:
        count = len(run.token_ids)
        raise RuntimeError(f"the request took one round ({count} tokens): no window")
    later = stats.rounds[1:]
    return Window(
        seconds=run.seconds,
        forward_seconds=sum(runner.device_seconds(run.started) for runner in runners),
        rounds=len(later),
        tokens=run.tokens,
        drafted=sum(r.drafted for r in later),
        kept=sum(r.accepted + r.loosely_accepted for r in later),
        syncs=run.syncs,
        token_ids=run.token_ids,
    )
