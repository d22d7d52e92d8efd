"""Counting the reads of tensor values into Python, the calls that synchronise the host with a
CUDA device (``int(t)``, ``t.item()``, ``t.tolist()``, ``bool(t)``, ``t.nonzero()``, copies to
the CPU): on the CPU nothing waits, but their number per round is what a GPU would pay."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

READS = frozenset(
    {"__int__", "__index__", "__float__", "__bool__", "item", "tolist", "nonzero", "cpu", "numpy"}
)


class HostReads(TorchFunctionMode):
    """Inside ``with HostReads() as reads``, ``reads.count`` is the number of reads so far."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))
