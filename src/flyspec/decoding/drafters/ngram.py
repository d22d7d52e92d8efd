"""Prompt lookup decoding: propose what followed an earlier occurrence of the context's tail."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from flyspec.config import DEFAULT_MAX_NGRAM
from flyspec.decoding.drafters.base import Draft, through_end


def find_ngram_continuation(
    context: Sequence[int] | np.ndarray,
    *,
    k: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = 1,
) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram.

    n runs from ``max_ngram`` down to ``min_ngram``; the first n with an earlier occurrence
    wins. Among its occurrences the most recent one with ``k`` tokens after it is used, else
    the earliest (the longest continuation there is). Returns ``[]`` when no suffix recurs.
    """
    tokens = np.asarray(context, dtype=np.int64)
    length = tokens.shape[0]
    if k < 1 or length < 2:
        return []
    for n in range(min(max_ngram, length - 1), max(min_ngram, 1) - 1, -1):
        suffix = tokens[length - n :]
        # Windows start at j = 0 .. length-1-n, so a continuation token tokens[j+n] exists.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size == 0:
            continue
        full = starts[starts + n + k <= length]
        start = int(full[-1]) if full.size else int(starts[0])
        return tokens[start + n : start + n + k].tolist()
    return []


class NgramDrafter:
    """Parameter-free drafting from the context itself (no model); the block ends after an
    ``end_tokens`` token (EOS)."""

    def __init__(
        self, *, max_ngram: int = DEFAULT_MAX_NGRAM, end_tokens: Collection[int] = ()
    ) -> None:
        self.max_ngram = max_ngram
        self.end_tokens = frozenset(end_tokens)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        continuation = find_ngram_continuation(context, k=k, max_ngram=self.max_ngram)
        continuation = through_end(continuation, self.end_tokens)
        return Draft(tokens=torch.tensor(continuation, dtype=torch.long), source="lookup")

    def reset(self) -> None:
        """Stateless."""
