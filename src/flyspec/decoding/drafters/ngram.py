"""Prompt lookup decoding: propose what followed an earlier occurrence of the context's tail."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from flyspec.config import DEFAULT_MAX_NGRAM
from flyspec.decoding.drafters.base import Draft, Drafter, DraftSource, through_end
from flyspec.models.cache import DeviceTokens


def find_ngram_continuation(
    context: Sequence[int] | np.ndarray,
    *,
    k: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = 1,
) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram
    (:func:`find_ngram_start`); ``[]`` when no suffix recurs."""
    start = find_ngram_start(context, k=k, max_ngram=max_ngram, min_ngram=min_ngram)
    if start is None:
        return []
    return [int(token) for token in context[start : start + k]]


def find_ngram_start(
    context: Sequence[int] | np.ndarray,
    *,
    k: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = 1,
) -> int | None:
    """Where in ``context`` the up to ``k`` tokens start that followed an earlier occurrence
    of the longest suffix n-gram, or None when no suffix recurs.

    n runs from ``max_ngram`` down to ``min_ngram``; the first n with an earlier occurrence
    wins. Among its occurrences the most recent one with ``k`` tokens after it is used, else
    the earliest (the longest continuation there is).
    """
    tokens = np.asarray(context, dtype=np.int64)
    length = tokens.shape[0]
    if k < 1 or length < 2:
        return None
    for n in range(min(max_ngram, length - 1), max(min_ngram, 1) - 1, -1):
        suffix = tokens[length - n :]
        # Windows start at j = 0 .. length-1-n, so a continuation token tokens[j+n] exists.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size == 0:
            continue
        full = starts[starts + n + k <= length]
        return int(full[-1] if full.size else starts[0]) + n
    return None


def block_from(
    ids: list[int], *, source: DraftSource, on_device: torch.Tensor | None = None
) -> Draft:
    """A read block of ``ids``: its tokens from ``on_device`` (``long[>= len(ids)]``, the
    same tokens on the device) where given, else from the host."""
    if not ids:
        tokens = torch.zeros(0, dtype=torch.long)
    elif on_device is None:
        tokens = torch.tensor(ids, dtype=torch.long)
    else:
        tokens = on_device[: len(ids)]
    return Draft(tokens=tokens, source=source, ids=tuple(ids))


class NgramDrafter(Drafter):
    """Parameter-free drafting from the context itself (no model); the block ends after an
    ``end_tokens`` token (EOS). ``context``: the request's context on the device, which its
    blocks are cut from where they continue it (none: blocks are copied from the host)."""

    def __init__(
        self,
        *,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        end_tokens: Collection[int] = (),
        context: DeviceTokens | None = None,
    ) -> None:
        self.max_ngram = max_ngram
        self.end_tokens = frozenset(end_tokens)
        self.context = context

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return look_up(
            context,
            k=k,
            max_ngram=self.max_ngram,
            end_tokens=self.end_tokens,
            on_device=self.context,
        )

    def reset(self) -> None:
        """Stateless."""


def look_up(
    context: Sequence[int],
    *,
    k: int,
    max_ngram: int,
    end_tokens: Collection[int],
    min_ngram: int = 1,
    on_device: DeviceTokens | None = None,
) -> Draft:
    """Prompt lookup's block after ``context`` (:func:`find_ngram_start`), cut after an end
    token; cut from ``on_device`` where that holds ``context``'s tokens there."""
    start = find_ngram_start(context, k=k, max_ngram=max_ngram, min_ngram=min_ngram)
    if start is None:
        return block_from([], source="lookup")
    ids = through_end([int(t) for t in context[start : start + k]], end_tokens)
    end = start + len(ids)
    found = None if on_device is None else on_device.find(context, start, end)
    return block_from(ids, source="lookup", on_device=found)
