"""Drafting from a prediction of the answer (OpenAI's Predicted Outputs): the text the answer
is expected to largely repeat, such as the code being edited.

The drafter keeps its place in the prediction: the index of the prediction token that the
next answer token should equal. While the answer follows the prediction, the place advances
with it and the block is the prediction's next ``k`` tokens. Where the answer leaves the
prediction (an edit), the place is found again from the answer's last tokens: the longest of
its tail n-grams (``min_match`` tokens at least) that occurs in the prediction, at the
occurrence nearest to where the answer would stand had it followed the prediction. Until it
is found again, and after the prediction's end, blocks come from prompt lookup in the context
(from a tail of ``min_match`` tokens at least) and then from the ``fallback`` drafter (the
draft model: MLA's idea, cheap proposals first); with neither, the round drafts nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from flyspec.config import DEFAULT_MAX_NGRAM
from flyspec.decoding.drafters.base import Draft, Drafter, through_end
from flyspec.decoding.drafters.ngram import block_from, look_up
from flyspec.errors import FlyspecError
from flyspec.models.cache import DeviceTokens

DEFAULT_MIN_MATCH = 3
"""Answer tokens that must match the prediction for its place to be found again: fewer would
match in many places of code (an indentation, a bracket)."""
MAX_MATCH = 32
"""The longest answer tail compared with the prediction."""
SURE_MATCH = 8
"""A place found from a match at least this long (or the answer so far, whole) is followed
with the trust of an unbroken run: ``-k auto`` keeps separate estimates for the two."""


@dataclass(frozen=True)
class Place:
    """Where the answer stands in the prediction: ``index`` of the prediction token the next
    answer token should equal, found from a match of the answer's last ``matched`` tokens."""

    index: int
    matched: int

    @property
    def sure(self) -> bool:
        return self.matched >= SURE_MATCH or self.index == self.matched


def find_place(
    prediction: np.ndarray,
    answer: Sequence[int],
    *,
    expected: int,
    min_match: int = DEFAULT_MIN_MATCH,
) -> Place | None:
    """Where ``answer`` (``long[n]``, the tokens generated so far) stands in ``prediction``
    (``long[P]``), or None when its tail matches nowhere.

    ``expected`` is the index the answer would stand at had it followed the prediction since
    its place was last known; it is checked first, then every occurrence of the longest tail
    n-gram (``min_match`` to :data:`MAX_MATCH` tokens) is weighed by its distance from it. An
    answer shorter than ``min_match`` that equals the prediction's start stands after it.
    """
    answer = np.asarray(answer[-MAX_MATCH:], dtype=np.int64)
    length = len(answer)
    if length == 0:
        return Place(index=0, matched=0)
    at_expected = _matched_before(prediction, answer, expected)
    if at_expected == length or at_expected >= SURE_MATCH:
        return Place(index=expected, matched=at_expected)
    for n in range(min(length, len(prediction)), min_match - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(prediction, n)
        starts = np.flatnonzero((windows == answer[length - n :]).all(axis=1))
        if starts.size:
            ends = starts + n
            return Place(index=int(ends[np.argmin(np.abs(ends - expected))]), matched=n)
    return None


def _matched_before(prediction: np.ndarray, answer: np.ndarray, index: int) -> int:
    """How many of ``answer``'s last tokens equal the prediction's tokens just before
    ``index``."""
    if not 0 <= index <= len(prediction):
        return 0
    span = min(index, len(answer))
    if span == 0:
        return 0
    before = prediction[index - span : index][::-1]
    tail = answer[len(answer) - span :][::-1]
    unequal = np.flatnonzero(before != tail)
    return int(unequal[0]) if unequal.size else span


class PredictionDrafter(Drafter):
    """Proposes the prediction's next tokens where the answer stands in it, else prompt
    lookup, else ``fallback`` (a drafter, or None for lookup alone).

    ``prediction``: the predicted answer's token ids; ``prompt_length``: how many tokens of
    every context are the prompt (the answer is what follows); ``end_tokens``: a block ends
    after one (EOS).
    """

    def __init__(
        self,
        prediction: Sequence[int],
        *,
        prompt_length: int,
        fallback: Drafter | None = None,
        min_match: int = DEFAULT_MIN_MATCH,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        end_tokens: Collection[int] = (),
        context: DeviceTokens | None = None,
    ) -> None:
        if len(prediction) == 0:
            raise FlyspecError("the prediction is empty: give at least one token, or none")
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.prompt_length = prompt_length
        self.fallback = fallback
        self.min_match = min_match
        self.max_ngram = max_ngram
        self.end_tokens = frozenset(end_tokens)
        self.context = context
        self._on_device = None
        if context is not None:
            self._on_device = DeviceTokens(prediction, device=context.device)
        self._known = Place(index=0, matched=0)
        self._known_at = 0  # answer length when the place was last known
        self._planned: tuple[int, Place | None] | None = None

    def place(self, context: Sequence[int]) -> Place | None:
        """Where the answer in ``context`` stands in the prediction (None: nowhere, or past
        its end)."""
        answer_length = len(context) - self.prompt_length
        if self._planned is not None and self._planned[0] == answer_length:
            return self._planned[1]
        expected = self._known.index + answer_length - self._known_at
        found = find_place(
            self.prediction,
            context[self.prompt_length :],
            expected=expected,
            min_match=self.min_match,
        )
        if found is not None:
            self._known, self._known_at = found, answer_length
        if found is not None and found.index >= len(self.prediction):
            found = None
        self._planned = (answer_length, found)
        return found

    def plan(self, context: Sequence[int]) -> str:
        """The kind of the next block: ``prediction-start`` (the answer's first, a guess that
        it opens as the prediction does: a chat answer often opens with a code fence
        first), ``prediction`` (in an unbroken run), ``prediction-found`` (a place found
        again from a short match), else the fallback's."""
        place = self.place(context)
        if place is not None:
            if place.matched == 0:
                return "prediction-start"
            return "prediction" if place.sure else "prediction-found"
        if len(self._look_up(context, 1)):
            return "lookup"
        return "model" if self.fallback is not None else "lookup"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        place = self.place(context)
        if place is not None:
            start = place.index
            ids = through_end(self.prediction[start : start + k].tolist(), self.end_tokens)
            on_device = None
            if self._on_device is not None:
                on_device = self._on_device.span(start, start + len(ids))
            return block_from(ids, source="prediction", on_device=on_device)
        looked_up = self._look_up(context, k)
        if len(looked_up) or self.fallback is None:
            return looked_up
        return self.fallback.propose(context, k)

    def _look_up(self, context: Sequence[int], k: int) -> Draft:
        """Prompt lookup from a tail of ``min_match`` tokens at least: a shorter one, in
        code, matches almost anywhere."""
        return look_up(
            context,
            k=k,
            max_ngram=max(self.max_ngram, self.min_match),
            min_ngram=self.min_match,
            end_tokens=self.end_tokens,
            on_device=self.context,
        )

    def reset(self) -> None:
        self._known, self._known_at, self._planned = Place(index=0, matched=0), 0, None
        if self.fallback is not None:
            self.fallback.reset()
