"""The drafter protocol: propose up to ``k`` tokens that continue a context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Draft:
    """A proposed block: ``tokens`` ``long[K]`` and, for a sampled draft, the distributions
    ``probs`` ``[K, V]`` it was sampled from (None means deterministic, i.e. one-hot)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> Draft:
        return Draft(tokens=torch.zeros(0, dtype=torch.long))


class Drafter(Protocol):
    """Anything that proposes a continuation. May return fewer than ``k`` tokens (even none)."""

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def reset(self) -> None:
        """Forget per-request state (caches) before a new request."""
        ...
