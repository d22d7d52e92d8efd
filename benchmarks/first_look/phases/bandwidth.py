"""``bandwidth``: a device-to-device copy of one large tensor (its device time, median),
counting the bytes read and written, as the ceiling of a memory-bound forward."""

from __future__ import annotations

import statistics

import torch

from ..models import release_memory
from ..plan import Sizes
from ..table import Row, fmt_count, fmt_ms
from ..timing import timed


def copy_times(device: torch.device, nbytes: int, *, repeats: int) -> list[float]:
    """Seconds of ``repeats`` copies of one random bfloat16 tensor of ``nbytes`` into another."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    copy = torch.empty_like(source)
    return [timed(device, lambda: copy.copy_(source)) for _ in range(repeats)]


def measure_copy_bandwidth(device: torch.device, sizes: Sizes) -> Row:
    """Bytes read plus bytes written per second by a device-to-device copy, median of 10."""
    times = copy_times(device, sizes.copy_bytes, repeats=13)[3:]
    release_memory(device)
    seconds = statistics.median(times)
    rate = 2 * sizes.copy_bytes / seconds
    return Row(
        "bandwidth",
        "device-to-device copy",
        "ok",
        fmt_count(rate, "B/s"),
        f"{sizes.copy_bytes / 2**30:.3g} GiB copied in {fmt_ms(seconds)}, median of 10 after "
        "3 warm-ups; bytes read + written",
        {"bytes_per_second": rate, "copy_bytes": sizes.copy_bytes, "seconds": seconds},
    )
