"""The decoder against a scripted drafter: every token's origin, EOS at every position, the
``max_new_tokens`` boundary and the drafter feedback, checked against a plain statement of
what a round of exact speculative decoding emits.

The drafter copies the target's own greedy continuation (computed beforehand) and spoils the
positions it is told to, so which drafted tokens match is known in advance.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.drafters import Draft, Drafter
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.errors import FlyspecError

VOCAB = 64
PROMPT = [3, 7, 11, 7, 3]
LENGTH = 24


@pytest.fixture(scope="module")
def reference(target) -> list[int]:
    """The target's greedy continuation of PROMPT."""
    decoder = SpeculativeDecoder(target)
    config = DecodeConfig(mode="target", max_new_tokens=LENGTH)
    return [event.token for event in decoder.stream(PROMPT, config)]


class ScriptedDrafter(Drafter):
    """Proposes the reference continuation, with the token at each output index in ``wrong``
    replaced by another one; records every request and every piece of feedback."""

    def __init__(self, reference: Sequence[int], wrong: set[int]) -> None:
        self.reference, self.wrong = list(reference), wrong
        self.requests: list[tuple[int, int]] = []  # (output index, k)
        self.observed: list[tuple[int, int]] = []  # (num_drafted, num_kept)

    def reset(self) -> None:
        self.requests.clear()
        self.observed.clear()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        start = len(context) - len(PROMPT)
        self.requests.append((start, k))
        block = [
            (token + 1) % VOCAB if index in self.wrong else token
            for index, token in enumerate(self.reference[start : start + k], start=start)
        ]
        return Draft(tokens=torch.tensor(block, dtype=torch.long))

    def observe(self, num_drafted: int, num_kept: int) -> None:
        self.observed.append((num_drafted, num_kept))


def expected_rounds(wrong: set[int], k: int, length: int) -> tuple[list[str], list[tuple]]:
    """Exact SPD stated plainly: the origins of the first ``length`` tokens and each round's
    (num_drafted, num_kept)."""
    origins: list[str] = []
    rounds = []
    while len(origins) < length:
        block = min(k, length - len(origins) - 1)
        start = len(origins)
        spoiled = [i for i in range(start, start + block) if i in wrong]
        kept = (spoiled[0] - start) if spoiled else block
        origins += ["exact"] * kept + ["correction" if spoiled else "bonus"]
        if block:
            rounds.append((block, kept))
    return origins, rounds


WRONG_PATTERNS = [set(), {0}, {2}, {0, 1, 2, 3}, {3, 4, 9, 17}, set(range(0, LENGTH, 2))]


@pytest.mark.parametrize("wrong", WRONG_PATTERNS, ids=str)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_origin_and_the_feedback_follow_the_rule(target, reference, wrong, k):
    decoder = SpeculativeDecoder(target)
    drafter = ScriptedDrafter(reference, wrong)
    config = DecodeConfig(mode="spd", k=k, max_new_tokens=LENGTH)
    events = list(decoder.stream(PROMPT, config, drafter=drafter))
    origins, rounds = expected_rounds(wrong, k, LENGTH)
    assert [event.token for event in events] == reference
    assert [event.origin for event in events] == origins
    assert drafter.observed == rounds


def test_an_eos_at_any_position_ends_the_request_there(target, reference):
    first_occurrences = [p for p in range(LENGTH) if reference[p] not in reference[:p]]
    assert len(first_occurrences) >= 6 and first_occurrences[0] == 0
    for position in first_occurrences:
        decoder = SpeculativeDecoder(target, eos_token_ids={reference[position]})
        for mode, drafter in (("target", None), ("spd", ScriptedDrafter(reference, wrong={5}))):
            config = DecodeConfig(mode=mode, k=4, max_new_tokens=LENGTH)
            events = list(decoder.stream(PROMPT, config, drafter=drafter))
            assert [event.token for event in events] == reference[:position], (position, mode)


@pytest.mark.parametrize("budget", range(1, 14))
def test_the_budget_is_met_exactly_and_never_drafted_past(target, reference, budget):
    decoder = SpeculativeDecoder(target)
    drafter = ScriptedDrafter(reference, wrong={6})
    config = DecodeConfig(mode="spd", k=5, max_new_tokens=budget)
    events = list(decoder.stream(PROMPT, config, drafter=drafter))
    assert [event.token for event in events] == reference[:budget]
    # a block of k leaves room for the token the target adds after it
    assert all(start + k + 1 <= budget for start, k in drafter.requests)
    assert [event.origin for event in events] == expected_rounds({6}, 5, budget)[0]


def test_a_drafter_is_refused_where_nothing_is_drafted(target, reference):
    decoder = SpeculativeDecoder(target)
    with pytest.raises(FlyspecError, match="mode 'target' drafts nothing"):
        next(
            decoder.stream(
                PROMPT, DecodeConfig(mode="target"), drafter=ScriptedDrafter(reference, set())
            )
        )
