"""Server metrics, exposed by ``prometheus-client`` in the Prometheus text format.

Every metric lives in the :class:`~prometheus_client.CollectorRegistry` of one
:class:`ServerMetrics`, owned by one app: nothing is registered globally, so several apps (the
tests make many) never share or clash.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from flyspec.decoding.stats import RequestStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

TAU_BUCKETS = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 25.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServerMetrics:
    """The metrics of one server. ``queue_length`` and ``running`` are read on each scrape."""

    def __init__(
        self,
        *,
        queue_length: Callable[[], float] = lambda: 0,
        running: Callable[[], float] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, documentation: str, labels: tuple[str, ...]) -> Counter:
            return Counter(name, documentation, labels, registry=self.registry)

        self.requests = counter(
            "flyspec_requests",
            "HTTP requests answered, by endpoint and status code",
            ("endpoint", "status"),
        )
        self.latency = Histogram(
            "flyspec_request_duration_seconds",
            "Time from receiving a generation request to the end of its response",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generations = counter(
            "flyspec_generations",
            "Generations by outcome: stop, length, timeout, cancelled (client gone), error",
            ("mode", "outcome"),
        )
        mode = ("mode",)
        self.prompt_tokens = counter(
            "flyspec_prompt_tokens", "Prompt tokens of generations run", mode
        )
        self.cached_prompt_tokens = counter(
            "flyspec_cached_prompt_tokens",
            "Prompt tokens read from the prompt cache instead of computed",
            mode,
        )
        self.generated_tokens = counter(
            "flyspec_generated_tokens", "Tokens generated (emitted)", mode
        )
        self.rounds = counter(
            "flyspec_rounds", "Decoding rounds (draft + one target forward)", mode
        )
        self.drafted = counter("flyspec_drafted_tokens", "Draft tokens proposed", mode)
        self.accepted = counter(
            "flyspec_accepted_tokens", "Draft tokens accepted on an exact match", mode
        )
        self.loosely_accepted = counter(
            "flyspec_loosely_accepted_tokens",
            "Draft tokens accepted loosely by FLy (mismatches kept)",
            mode,
        )
        self.rejected = counter("flyspec_rejected_tokens", "Draft tokens rejected", mode)
        self.tau = Histogram(
            "flyspec_tau",
            "Tokens emitted per round (tau) of each generation with at least one round",
            mode,
            buckets=TAU_BUCKETS,
            registry=self.registry,
        )
        self.queue_length = Gauge(
            "flyspec_queue_length", "Requests waiting for the engine", registry=self.registry
        )
        self.running = Gauge(
            "flyspec_requests_running",
            "Generations running now (0 or 1)",
            registry=self.registry,
        )
        self.read_queue(queue_length=queue_length, running=running)

    def read_queue(self, *, queue_length: Callable[[], float], running: Callable[[], float]):
        """Where the two gauges read the queue's state at each scrape."""
        self.queue_length.set_function(queue_length)
        self.running.set_function(running)

    def observe_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        """Count one answered HTTP request (and its latency, for generation endpoints)."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if seconds is not None:
            self.latency.labels(endpoint=endpoint).observe(seconds)

    def observe_generation(self, mode: str, stats: RequestStats, outcome: str) -> None:
        """Add one generation's statistics (also for cancelled or timed-out ones)."""
        self.generations.labels(mode=mode, outcome=outcome).inc()
        for counter, amount in (
            (self.prompt_tokens, stats.prompt_tokens),
            (self.cached_prompt_tokens, stats.cached_prompt_tokens),
            (self.generated_tokens, stats.emitted),
            (self.rounds, stats.num_rounds),
            (self.drafted, stats.drafted),
            (self.accepted, stats.accepted),
            (self.loosely_accepted, stats.loosely_accepted),
            (self.rejected, stats.rejected),
        ):
            counter.labels(mode=mode).inc(amount)
        if stats.num_rounds:
            self.tau.labels(mode=mode).observe(stats.tau)

    def render(self) -> bytes:
        """The whole exposition, as a scrape receives it."""
        return generate_latest(self.registry)
