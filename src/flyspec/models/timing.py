"""The one way flyspec times work on a device, in two forms.

- :func:`device_clock`: a clock that first waits for the work queued on the device, read
  before and after a call, so that the seconds are the work's and not its launch's (CUDA runs
  kernels asynchronously; on the CPU a forward is done when it returns). For a forward timed
  alone: ``-k auto``'s cost measurement, ``flyspec bench --forward-cost`` and the first-look
  script's ``V(n)``.
- :class:`DeviceSpan`: the device's own time for the work issued in a block, measured without
  waiting (CUDA events recorded on the device's queue before and after it; the clock on the
  CPU). For work inside a run that must not be made to wait: the first-look script times every
  forward of a decode this way, and the loop's own time is the decode's wall time minus its
  forwards'; a wait around each forward would add the very host synchronisations it counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def wait_for_device(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done: CUDA runs it asynchronously; the CPU
    has already done it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` that first waits for ``device``'s queued work: read before and
    after a forward, it times the forward itself."""

    def clock() -> float:
        wait_for_device(device)
        return time.perf_counter()

    return clock


class DeviceSpan:
    """``with DeviceSpan(device) as span:`` around work; ``span.seconds()`` afterwards: the
    seconds the device spent between the block's start and end, read without a wait inside
    the block. On CUDA, events recorded on the current queue (their interval is read once the
    device has reached the second); on the CPU, where work is done when it returns, the
    clock around the block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._started = 0.0
        self._seconds = 0.0

    def __enter__(self) -> DeviceSpan:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._events = (start, end)
            start.record()
        else:
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._started

    def seconds(self) -> float:
        """The block's device seconds (on CUDA, once the device has done its work)."""
        if self._events is None:
            return self._seconds
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1000
