"""The one way flyspec times a forward: a clock that first waits for the work queued on the
device, read before and after the call, so that the seconds are the work's and not its launch's
(CUDA runs kernels asynchronously; on the CPU a forward is done when it returns). ``-k auto``'s
cost measurement, ``flyspec bench --forward-cost`` and the first-look script use it."""

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
