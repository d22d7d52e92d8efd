"""Loosely accepted tokens, counted where vLLM verifies (a worker process) and shown where
vLLM reports (its front end: ``LLM.get_metrics()`` and the server's ``/metrics``).

The two are different processes, so each verifying process writes its running count to a small
file in a folder named by ``FLYSPEC_VLLM_STATS_DIR``, which the first process to load the plugin
(the front end) chooses and its engine processes inherit. The front end's Prometheus collector
sums the files at each scrape. Every 10 seconds with new counts a worker also logs one line.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("vllm.flyspec")  # under vLLM's own log handler and level

STATS_DIR_VARIABLE = "FLYSPEC_VLLM_STATS_DIR"
METRIC_NAME = "vllm:spec_decode_num_loosely_accepted_tokens"
METRIC_HELP = (
    "Draft tokens emitted after FLy loosely accepted them (flyspec plugin; they are also "
    "counted in vllm:spec_decode_num_accepted_tokens)"
)
WRITE_INTERVAL_S = 1.0
LOG_INTERVAL_S = 10.0


def choose_stats_dir() -> Path:
    """The folder this vLLM instance's counts go to: inherited, or named now (created only
    when a worker first writes)."""
    if STATS_DIR_VARIABLE not in os.environ:
        name = f"flyspec-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.environ[STATS_DIR_VARIABLE] = str(Path(tempfile.gettempdir()) / name)
    return Path(os.environ[STATS_DIR_VARIABLE])


def read_total(stats_dir: Path) -> int | None:
    """Sum of the counts in ``stats_dir``, or None where no worker has written any."""
    if not stats_dir.is_dir():
        return None
    total, found = 0, False
    for path in stats_dir.glob("loose-*.json"):
        try:
            total += int(json.loads(path.read_text())["loosely_accepted"])
            found = True
        except (OSError, ValueError, KeyError):  # a file being replaced
            continue
    return total if found else None


def remove_counts_of_ended_processes(stats_dir: Path) -> None:
    """Forget the counts of engines that have ended (an earlier ``LLM`` in the same front
    end), so that the published total is this engine's, like vLLM's own counters."""
    for path in stats_dir.glob("loose-*.json"):
        try:
            os.kill(int(path.stem.removeprefix("loose-")), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue


class LooseTokensCollector:
    """Prometheus collector of :data:`METRIC_NAME` for the process that serves metrics."""

    def __init__(self, stats_dir: Path) -> None:
        self.stats_dir = stats_dir

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        total = read_total(self.stats_dir)
        if total is not None:
            yield CounterMetricFamily(METRIC_NAME, METRIC_HELP, value=total)

    def describe(self) -> list:
        return []  # nothing to check at registration; the metric appears once counted


def register_collector(stats_dir: Path) -> None:
    """Add the collector to prometheus_client's default registry (which vLLM serves)."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    if not any(
        isinstance(collector, LooseTokensCollector)
        for collector in list(REGISTRY._collector_to_names)
    ):
        REGISTRY.register(LooseTokensCollector(stats_dir))


class LooseCounter:
    """The running count of one verifying process. On the CPU it is written at every step; on
    an accelerator it stays on the device and is read back at most once a second (one host
    sync), so the hot path does not wait for it and the published count lags by that much."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.pending: torch.Tensor | None = None
        self.total = 0
        self.logged_total = 0
        self.last_write = self.last_log = time.monotonic()

    @classmethod
    def for_this_process(cls) -> LooseCounter:
        """A counter writing to this instance's stats folder, from the first tensor-parallel
        rank only (every rank verifies the same batch)."""
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            first_rank = get_tensor_model_parallel_rank() == 0
        except (ImportError, AssertionError, RuntimeError):
            first_rank = True
        stats_dir = choose_stats_dir()
        remove_counts_of_ended_processes(stats_dir)
        return cls(stats_dir / f"loose-{os.getpid()}.json" if first_rank else None)

    def add(self, emitted_loose: torch.Tensor) -> None:
        """Count the loosely accepted positions that were emitted: ``bool[T]``."""
        count = emitted_loose.sum()
        self.pending = count if self.pending is None else self.pending + count
        now = time.monotonic()
        if count.device.type == "cpu" or now - self.last_write >= WRITE_INTERVAL_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.pending is not None:
            self.total += int(self.pending)
            self.pending = None
        self.last_write = now
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps({"loosely_accepted": self.total}))
            partial.replace(self.path)
        if now - self.last_log >= LOG_INTERVAL_S and self.total != self.logged_total:
            logger.info(
                "flyspec FLy: %d draft tokens accepted loosely (%d in the last %.0f s)",
                self.total,
                self.total - self.logged_total,
                now - self.last_log,
            )
            self.logged_total = self.total
            self.last_log = now
