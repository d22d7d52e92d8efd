"""What the decoding loop carries between rounds and hands to its caller: the committed
tokens' events, the request's progress, tokens held for a deferred window, the busy clock.
Internal to :mod:`flyspec.decode` but for :class:`TokenEvent` and :data:`Origin`."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from flyspec.drafters import Draft
from flyspec.stats import LooseToken, RequestStats
from flyspec.verify import Verdict

Origin = Literal["exact", "loose", "correction", "bonus"]
"""How an emitted token was obtained: an exactly accepted draft token, a loosely accepted one,
the target's correction at the cut, or the target's bonus token after a fully kept block (with
the target alone every token is a bonus of an empty block)."""


@dataclass(frozen=True)
class TokenEvent:
    """One committed token, yielded as soon as its round is verified."""

    token: int
    origin: Origin
    round_index: int

    @property
    def from_draft(self) -> bool:
        return self.origin in ("exact", "loose")


class BusyClock:
    """Time spent inside the generator, excluding the caller's time between two yields."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.paused = 0.0
        self._pause_start: float | None = None

    def pause(self) -> None:
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        if self._pause_start is not None:
            self.paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused


@dataclass(frozen=True)
class Held:
    """Tokens kept tentatively after a deferred mismatch (``FlyConfig.defer``): already in
    the context, not yet emitted; the next block confirms them or rolls them back to the
    target's ``correction``. ``round_slot`` indexes the deferring round's statistics."""

    tokens: list[int]  # the mismatched draft token, the exact matches after it, the bonus
    origins: list[Origin]
    need: int
    correction: int
    round_index: int
    round_slot: int
    loose_token: LooseToken

    def resolve(
        self, confirmed: bool, stats: RequestStats, *, eos_token_ids: Collection[int]
    ) -> list[tuple[TokenEvent, int]]:
        """Settle the deferring round's statistics; the events it now emits: the held tokens
        when ``confirmed``, else the correction (none when that ends the request)."""
        before = stats.rounds[self.round_slot]
        if confirmed:
            stats.rounds[self.round_slot] = replace(
                before,
                accepted=before.accepted + len(self.tokens) - 2,
                loosely_accepted=before.loosely_accepted + 1,
                emitted=before.emitted + len(self.tokens),
                deferral="confirmed",
                loose_tokens=(*before.loose_tokens, self.loose_token),
            )
            pairs = zip(self.tokens, self.origins, strict=True)
            return [(self._event(token, origin), self.round_slot) for token, origin in pairs]
        ends = self.correction in eos_token_ids
        stats.rounds[self.round_slot] = replace(
            before,
            emitted=before.emitted + (not ends),
            ended_by_eos=ends,
            deferral="rolled_back",
        )
        return [] if ends else [(self._event(self.correction, "correction"), self.round_slot)]

    def _event(self, token: int, origin: Origin) -> TokenEvent:
        return TokenEvent(token=token, origin=origin, round_index=self.round_index)


@dataclass
class Progress:
    """A request's state between rounds: the context (prompt, emitted and held tokens), how
    many tokens were emitted, the tokens held for a deferred window, the round's index."""

    context: list[int]
    produced: int = 0
    held: Held | None = None
    round_index: int = 0

    @property
    def held_length(self) -> int:
        return 0 if self.held is None else len(self.held.tokens)


@dataclass(frozen=True)
class Round:
    """One round's draft, its verdict and the target's ``[K+1, V]`` logits, with timings."""

    draft: Draft
    verdict: Verdict
    target_logits: torch.Tensor
    draft_seconds: float
    verify_seconds: float


def deliver(
    events: Sequence[tuple[TokenEvent, int]], stats: RequestStats, clock: BusyClock
) -> Iterator[TokenEvent]:
    """Yield a round's events (each with the index of the round statistics it counts in);
    when the caller stops early, the tokens it never received are taken off their rounds'
    ``emitted``."""
    for delivered, (event, _) in enumerate(events, start=1):
        clock.pause()
        try:
            yield event
        except GeneratorExit:
            for _, slot in events[delivered:]:
                stats.rounds[slot] = replace(
                    stats.rounds[slot], emitted=stats.rounds[slot].emitted - 1
                )
            stats.finish_reason = "cancelled"
            raise
        clock.resume()
