"""The drafter protocol: propose up to ``k`` tokens that continue a context."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

DraftSource = Literal["model", "lookup", "prediction"]
"""Where a block's tokens come from: the draft model (alone or with MLA's n-gram proposals),
prompt lookup in the context, or the request's prediction of its answer."""


@dataclass(frozen=True)
class Draft:
    """A proposed block: ``tokens`` ``long[K]``; for a sampled draft, the distributions
    ``probs`` ``[K, V]`` it was sampled from (None means deterministic, i.e. one-hot); and the
    draft model's ``confidence`` ``float[K]`` in each of its tokens (:func:`token_confidence`;
    None for drafters without a model, such as prompt lookup); and where the tokens come from
    (``source``). ``tokens`` may be on the CPU or on a device; ``ids`` are the same tokens as
    the host knows them (None: read them from ``tokens`` when needed). A read block is cut
    after an end token. An ``unread`` block stays on the draft model's device, uncut, for
    the decoder to read with its verdict and hand back to ``settle`` (the drafter's record of
    what its steps fed). ``probs`` and ``confidence`` may stay on the draft model's
    device."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    source: DraftSource = "model"
    unread: bool = False
    settle: Callable[[list[int]], None] | None = None
    ids: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> Draft:
        return Draft(tokens=torch.zeros(0, dtype=torch.long), ids=())

    @property
    def token_ids(self) -> list[int]:
        """The block's token ids (read from :attr:`tokens` where the host does not know
        them yet)."""
        return list(self.ids) if self.ids is not None else self.tokens.tolist()

    def settled(self, ids: Sequence[int], length: int) -> Draft:
        """The read draft: ``ids``, the values of :attr:`tokens`, given to :attr:`settle`, and
        the block as the decoder goes on with it, its first ``length`` tokens (left where
        they are, with their ids)."""
        if self.settle is not None:
            self.settle(list(ids))
        return Draft(
            tokens=self.tokens[:length],
            probs=None if self.probs is None else self.probs[:length],
            confidence=None if self.confidence is None else self.confidence[:length],
            source=self.source,
            ids=tuple(ids[:length]),
        )


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes a continuation: :meth:`propose` and :meth:`reset`, and two
    optional hooks (:meth:`plan`, :meth:`observe`) whose defaults a subclass inherits. A
    drafter that does not subclass it defines all four."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens to follow ``context``; fewer (even none) where it has no more."""
        ...

    def reset(self) -> None:
        """Forget per-request state (caches) before a new request."""
        ...

    def plan(self, context: Sequence[int]) -> str | None:
        """The kind of block it would propose next after ``context`` (``-k auto`` keeps one
        set of estimates per kind, as blocks of different kinds cost and keep differently);
        None, the default: the kind its settings name (``model``, or ``lookup`` for n-gram
        drafting)."""
        return None

    def observe(self, num_drafted: int, num_kept: int) -> None:
        """Told after each verified block how many of the ``num_drafted`` tokens it proposed
        were kept (exactly or loosely), e.g. to adapt how many it drafts next; by default
        nothing is done with it."""
        return None


def token_confidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The draft model's probability of each of ``tokens`` ``long[n]``: the softmax of its raw
    ``logits`` ``[n, V]`` (temperature 1, whatever it sampled at). ``-> float[n]``."""
    return torch.softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]


def first_unconfident(confidence: torch.Tensor, min_confidence: float) -> int | None:
    """Index of the first token whose ``confidence`` ``float[n]`` (:func:`token_confidence`)
    is below ``min_confidence``, or None when there is none or the check is off
    (``min_confidence == 0``).

    A drafter ends its block after that token: the tokens it would draft next are likely to be
    rejected, so their forwards are saved.
    """
    if min_confidence <= 0:
        return None
    unconfident = (confidence < min_confidence).nonzero()
    return int(unconfident[0, 0]) if unconfident.numel() else None


def through_end(tokens: list[int], end_tokens: Collection[int]) -> list[int]:
    """``tokens`` up to and including the first that ends a request (all when none does)."""
    ends_at = end_index(tokens, end_tokens)
    return tokens if ends_at is None else tokens[: ends_at + 1]


def end_index(tokens: Sequence[int], end_tokens: Collection[int]) -> int | None:
    """Index of the first of ``tokens`` that ends a request (EOS), or None.

    Drafters end their block there: nothing after an end token can be emitted, so drafting
    (and verifying) past it is wasted work.
    """
    for index, token in enumerate(tokens):
        if token in end_tokens:
            return index
    return None
