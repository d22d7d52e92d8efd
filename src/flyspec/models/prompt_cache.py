"""The prompt cache over many prompts: the KV states of recent requests, kept in host memory
within a budget and restored by longest common prefix, as llama-server's ``--cache-ram``.

A model's live cache holds one sequence: the request before. Agents, editors and multi-turn
chats come back to earlier prompts (a conversation's next turn starts with the last one and its
answer). At the end of each request the decoder keeps each model's state here
(:meth:`~flyspec.models.cache.CachedLM.keep`), keyed by the tokens it holds; a request whose
prompt shares more with a kept state than with the live cache has that state restored before it
reads the rest (:meth:`~flyspec.models.cache.CachedLM.prefill`). The least recently used states
go first when the budget is full; a state whose tokens begin another kept one's of the same
model is dropped for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CACHE_BYTES = 2 * 1024**3
"""The default budget: 2 GiB, about 37,000 positions of the default float32 target's keys and
values (56 KiB a position: 28 layers, 2 key-value heads of 128) or 75,000 in llama.cpp's
16-bit cache, by arithmetic on the model's shapes."""


@dataclass
class KeptState:
    """A model's cache as it was: the ``tokens`` its positions hold and the runner's
    ``state`` of them (:meth:`~flyspec.models.cache.ForwardRunner.snapshot`), ``nbytes``
    of host memory."""

    model: str
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    used: int = field(default=0)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    limit = min(len(a), len(b))
    if list(a[:limit]) == list(b[:limit]):
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


class PromptCache:
    """Kept states of any number of models (each named by its role, ``target`` or ``draft``)
    within ``budget_bytes`` in all."""

    def __init__(self, budget_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.states: list[KeptState] = []
        self.restored_tokens = 0
        """Positions restored instead of computed, over the cache's life."""
        self._clock = 0

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self.states)

    def best(self, model: str, tokens: Sequence[int]) -> tuple[KeptState, int] | None:
        """The kept state of ``model`` that shares the longest prefix with ``tokens``, and
        that length (None where none shares a token)."""
        found, longest = None, 0
        for kept in self.states:
            if kept.model != model:
                continue
            shared = common_prefix_length(kept.tokens, tokens)
            if shared > longest:
                found, longest = kept, shared
        if found is None:
            return None
        self._clock += 1
        found.used = self._clock
        return found, longest

    def put(self, model: str, tokens: Sequence[int], state: Any, nbytes: int) -> bool:
        """Keep ``state``, a cache of ``model`` holding ``tokens``; False where it alone is
        over the budget (nothing is kept then). States it makes needless (the same model's,
        whose tokens begin ``tokens``) leave, then the least recently used until it fits."""
        if nbytes > self.budget_bytes or not tokens:
            return False
        tokens = tuple(tokens)
        self.states = [
            kept
            for kept in self.states
            if not (kept.model == model and tokens[: len(kept.tokens)] == kept.tokens)
        ]
        self._clock += 1
        self.states.append(KeptState(model, tokens, state, nbytes, used=self._clock))
        while self.nbytes > self.budget_bytes:
            self.states.remove(min(self.states, key=lambda kept: kept.used))
        return True

    def holds(self, model: str, tokens: Sequence[int]) -> bool:
        """Whether a kept state of ``model`` holds all of ``tokens``'s positions."""
        tokens = tuple(tokens)
        return any(
            kept.model == model and kept.tokens[: len(tokens)] == tokens for kept in self.states
        )
