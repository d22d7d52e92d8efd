"""Counting the reads of tensor values into Python, the calls that synchronise the host with a
CUDA device (``int(t)``, ``t.item()``, ``t.tolist()``, ``bool(t)``, ``t.nonzero()``, copies to
the CPU), and the tensors made from Python values (``torch.tensor``, ``torch.as_tensor``),
which on CUDA are copies from the host, waiting unless pinned: on the CPU nothing waits, but
their number per round is what a GPU would pay. numpy's array interface (``np.asarray``) on a
CPU tensor, which shares its memory and which no path for a GPU takes
(:func:`flyspec.decoding.verify.greedy_tokens`), is not a read."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

READS = frozenset(
    {"__int__", "__index__", "__float__", "__bool__", "item", "tolist", "nonzero", "cpu", "numpy"}
)
FROM_HOST = frozenset({"tensor", "as_tensor"})


class HostReads(TorchFunctionMode):
    """Inside ``with HostReads() as reads``, ``reads.count`` is the number of reads so far, and
    ``reads.from_host`` the number of tensors made from Python values."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.from_host = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in READS:
            self.count += 1
        elif name in FROM_HOST:
            self.from_host += 1
        return func(*args, **(kwargs or {}))
