"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Every metric lives on a :class:`ServerMetrics` instance owned by one app: nothing global. The
instance is only touched from the event loop thread, so it needs no lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from flyspec.stats import RequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LabelValues = tuple[str, ...]

TAU_BUCKETS = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 25.0)
LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labels = tuple(labels)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> str:
        return "\n".join([*self.header(), *self.samples()])


class Counter(_Metric):
    """A monotonically increasing value per label set (its name should end in ``_total``)."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self.values: dict[LabelValues, float] = {}
        if not self.labels:
            self.values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[str]:
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{_format_labels(self.labels, key)} {_format_value(value)}"


class Gauge(_Metric):
    """A value read when the metrics are rendered."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        super().__init__(name, help)
        self.read = read

    def samples(self) -> Iterable[str]:
        yield f"{self.name} {_format_value(float(self.read()))}"


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        self.series: dict[LabelValues, tuple[list[int], list[float]]] = {}
        if not self.labels:
            self._series(())

    def _series(self, key: LabelValues) -> tuple[list[int], list[float]]:
        if key not in self.series:
            self.series[key] = ([0] * (len(self.buckets) + 1), [0.0])
        return self.series[key]

    def observe(self, value: float, **labels: str) -> None:
        counts, total = self._series(self._key(labels))
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                counts[index] += 1
        counts[-1] += 1  # +Inf
        total[0] += value

    def count(self, **labels: str) -> int:
        key = self._key(labels)
        return self.series[key][0][-1] if key in self.series else 0

    def samples(self) -> Iterable[str]:
        for key, (counts, total) in sorted(self.series.items()):
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                labels = _format_labels((*self.labels, "le"), (*key, _format_value(bound)))
                yield f"{self.name}_bucket{labels} {count}"
            labels = _format_labels(self.labels, key)
            yield f"{self.name}_sum{labels} {_format_value(total[0])}"
            yield f"{self.name}_count{labels} {counts[-1]}"


class ServerMetrics:
    """The metrics of one server. ``queue_length`` and ``running`` are read on render."""

    def __init__(
        self,
        *,
        queue_length: Callable[[], float] = lambda: 0,
        running: Callable[[], float] = lambda: 0,
    ) -> None:
        self.requests = Counter(
            "flyspec_requests_total",
            "HTTP requests answered, by endpoint and status code",
            ("endpoint", "status"),
        )
        self.latency = Histogram(
            "flyspec_request_duration_seconds",
            "Time from receiving a generation request to the end of its response",
            LATENCY_BUCKETS,
            ("endpoint",),
        )
        self.generations = Counter(
            "flyspec_generations_total",
            "Generations by outcome: stop, length, timeout, cancelled (client gone), error",
            ("mode", "outcome"),
        )
        self.prompt_tokens = Counter(
            "flyspec_prompt_tokens_total", "Prompt tokens of generations run", ("mode",)
        )
        self.generated_tokens = Counter(
            "flyspec_generated_tokens_total", "Tokens generated (emitted)", ("mode",)
        )
        self.rounds = Counter(
            "flyspec_rounds_total", "Decoding rounds (draft + one target forward)", ("mode",)
        )
        self.drafted = Counter("flyspec_drafted_tokens_total", "Draft tokens proposed", ("mode",))
        self.accepted = Counter(
            "flyspec_accepted_tokens_total", "Draft tokens accepted on an exact match", ("mode",)
        )
        self.loosely_accepted = Counter(
            "flyspec_loosely_accepted_tokens_total",
            "Draft tokens accepted loosely by FLy (mismatches kept)",
            ("mode",),
        )
        self.rejected = Counter("flyspec_rejected_tokens_total", "Draft tokens rejected", ("mode",))
        self.tau = Histogram(
            "flyspec_tau",
            "Tokens emitted per round (tau) of each generation with at least one round",
            TAU_BUCKETS,
            ("mode",),
        )
        self.queue_length = Gauge(
            "flyspec_queue_length", "Requests waiting for the engine", queue_length
        )
        self.running = Gauge(
            "flyspec_requests_running", "Generations running now (0 or 1)", running
        )

    @property
    def all(self) -> tuple[_Metric, ...]:
        return (
            self.requests,
            self.latency,
            self.generations,
            self.prompt_tokens,
            self.generated_tokens,
            self.rounds,
            self.drafted,
            self.accepted,
            self.loosely_accepted,
            self.rejected,
            self.tau,
            self.queue_length,
            self.running,
        )

    def observe_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        """Count one answered HTTP request (and its latency, for generation endpoints)."""
        self.requests.inc(endpoint=endpoint, status=str(status))
        if seconds is not None:
            self.latency.observe(seconds, endpoint=endpoint)

    def observe_generation(self, mode: str, stats: RequestStats, outcome: str) -> None:
        """Add one generation's statistics (also for cancelled or timed-out ones)."""
        self.generations.inc(mode=mode, outcome=outcome)
        self.prompt_tokens.inc(stats.prompt_tokens, mode=mode)
        self.generated_tokens.inc(stats.emitted, mode=mode)
        self.rounds.inc(stats.num_rounds, mode=mode)
        self.drafted.inc(stats.drafted, mode=mode)
        self.accepted.inc(stats.accepted, mode=mode)
        self.loosely_accepted.inc(stats.loosely_accepted, mode=mode)
        self.rejected.inc(stats.rejected, mode=mode)
        if stats.num_rounds:
            self.tau.observe(stats.tau, mode=mode)

    def render(self) -> str:
        """The whole exposition, ending with a newline."""
        return "\n".join(metric.render() for metric in self.all) + "\n"
