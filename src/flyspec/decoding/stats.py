"""Per-round and per-request statistics of speculative decoding."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LooseToken:
    """One loosely kept draft token and what the target thought of it (the evidence for
    the loosening rules): its index among the request's emitted tokens, its position in a
    block of ``block_size`` drafted tokens, whether its window completed in the next block
    (``deferred``), and the target's entropy there (of the gate's kind), probability of the
    draft token, ratio of that to its top token's, the draft token's rank (1 = top) and the
    target's own token; and the draft model's confidence in its token (its probability of it,
    None for a drafter without a model)."""

    output_index: int
    position: int
    block_size: int
    deferred: bool
    draft_token: int
    target_token: int
    entropy: float
    draft_prob: float
    top_prob: float
    ratio: float
    rank: int
    draft_confidence: float | None = None


@dataclass(frozen=True)
class DeferralDecision:
    """How a round decided the window the round before it deferred (``FlyConfig.defer``):
    ``confirmed``, the held draft tokens are kept (the deferred one loosely, ``loose_tokens``;
    the ``exact`` matches after it) and emitted with that block's bonus; rolled back, the
    target's correction is emitted in their place (``emitted`` 0 where it ends the request).
    """

    confirmed: bool
    exact: int
    loose_tokens: tuple[LooseToken, ...]
    emitted: int

    @property
    def kept(self) -> int:
        """Draft tokens of the deferring round's block this decision kept."""
        return self.exact + len(self.loose_tokens)


@dataclass(frozen=True)
class RoundStats:
    """One round, final once committed: draft ``drafted`` tokens, verify, keep ``accepted +
    loosely_accepted`` of them and emit ``emitted`` tokens (the kept ones plus a correction or
    bonus, fewer when the request ended inside the round).

    With ``FlyConfig.defer`` a round may end ``deferred``: its last mismatch and the tokens
    after it are held back, neither kept nor emitted by it. The next round decides them
    (``decided``) and counts what that emits in its own ``emitted``; when it rolls them back,
    its own block (drafted after the tokens taken back) keeps nothing."""

    drafted: int
    accepted: int
    loosely_accepted: int
    emitted: int
    draft_seconds: float
    verify_seconds: float
    ended_by_eos: bool = False
    deferred: bool = False
    decided: DeferralDecision | None = None
    loose_tokens: tuple[LooseToken, ...] = ()
    source: str | None = None
    """Where the drafted tokens came from (:data:`flyspec.decoding.drafters.base.DraftSource`), None
    when none were drafted."""

    @property
    def committed(self) -> int:
        """Tokens the round produced, counting an end-of-sequence token (never emitted)."""
        return self.emitted + int(self.ended_by_eos)

    @property
    def kept(self) -> int:
        """Draft tokens of this round's block it kept, exactly or loosely."""
        return self.accepted + self.loosely_accepted

    @property
    def rejected(self) -> int:
        """Draft tokens this round did not keep: the one at the cut and every one after it
        (those it deferred included)."""
        return self.drafted - self.kept


def kept_per_block(rounds: Sequence[RoundStats]) -> list[int]:
    """The draft tokens each round's block kept in the end: its own kept ones, and for a
    round that deferred, those the round after it confirmed (``rounds`` in order; the rounds
    of several requests one after another are fine)."""
    kept = [r.kept for r in rounds]
    for index, (before, after) in enumerate(zip(rounds, rounds[1:], strict=False)):
        if before.deferred and after.decided is not None:
            kept[index] += after.decided.kept
    return kept


@dataclass
class RequestStats:
    """Statistics of one request, filled in by the decoding loop as it runs.

    ``accepted`` counts exact acceptances, ``loosely_accepted`` the mismatches FLy kept;
    ``tau`` is the mean number of tokens committed per round, an end-of-sequence token
    included (1 for the target alone);
    ``seconds`` is the time spent inside the decoder (prefill included, the caller's time
    between tokens excluded).
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt positions the target did not compute: held from the request before, or
    restored from the prompt cache."""
    rounds: list[RoundStats] = field(default_factory=list)
    undelivered: int = 0
    """Committed tokens the caller never took: it stopped iterating first."""
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    finish_reason: str | None = None

    def add_round(self, round_stats: RoundStats) -> None:
        self.rounds.append(round_stats)

    @property
    def decisions(self) -> list[DeferralDecision]:
        """The deferred windows decided, in order."""
        return [r.decided for r in self.rounds if r.decided is not None]

    def _total(self, name: str) -> int | float:
        return sum(getattr(r, name) for r in self.rounds)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def drafted(self) -> int:
        return int(self._total("drafted"))

    @property
    def accepted(self) -> int:
        """Draft tokens kept exactly, confirmed deferred windows included."""
        return int(self._total("accepted")) + sum(d.exact for d in self.decisions)

    @property
    def loosely_accepted(self) -> int:
        return int(self._total("loosely_accepted")) + sum(
            len(d.loose_tokens) for d in self.decisions
        )

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted - self.loosely_accepted

    @property
    def emitted(self) -> int:
        """Tokens the caller received."""
        return int(self._total("emitted")) - self.undelivered

    @property
    def committed(self) -> int:
        """Tokens the caller received, an end-of-sequence token counted."""
        return sum(r.committed for r in self.rounds) - self.undelivered

    @property
    def loose_tokens(self) -> list[LooseToken]:
        """Every loosely kept token, in order (a deferred one with the round that confirmed
        it)."""
        return [
            token
            for r in self.rounds
            for token in (*(() if r.decided is None else r.decided.loose_tokens), *r.loose_tokens)
        ]

    @property
    def accepted_prediction_tokens(self) -> int:
        """Tokens drafted from the request's prediction and kept (exactly or loosely)."""
        return sum(kept for r, kept in self._blocks() if r.source == "prediction")

    @property
    def rejected_prediction_tokens(self) -> int:
        """Tokens drafted from the request's prediction and not kept; a prediction token
        proposed in two rounds and rejected in both counts twice."""
        return sum(r.drafted - kept for r, kept in self._blocks() if r.source == "prediction")

    def _blocks(self) -> list[tuple[RoundStats, int]]:
        """Each round with what its block kept in the end (:func:`kept_per_block`)."""
        return list(zip(self.rounds, kept_per_block(self.rounds), strict=True))

    def deferrals(self, outcome: str) -> int:
        """Deferred windows decided with ``outcome`` (``confirmed``, ``rolled_back``)."""
        if outcome not in ("confirmed", "rolled_back"):
            raise ValueError(f"no deferral outcome {outcome!r}: confirmed or rolled_back")
        return sum(d.confirmed == (outcome == "confirmed") for d in self.decisions)

    @property
    def draft_seconds(self) -> float:
        return float(self._total("draft_seconds"))

    @property
    def verify_seconds(self) -> float:
        return float(self._total("verify_seconds"))

    @property
    def tau(self) -> float:
        if not self.rounds:
            return 0.0
        return self.committed / self.num_rounds

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str | None]:
        """The summary figures under their public names (CLI ``--json``, server, bench)."""
        return {
            "rounds": self.num_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "loosely_accepted": self.loosely_accepted,
            "rejected": self.rejected,
            "emitted": self.emitted,
            "committed": self.committed,
            "tau": round(self.tau, 4),
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 4),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "finish_reason": self.finish_reason,
            "deferrals_confirmed": self.deferrals("confirmed"),
            "deferrals_rolled_back": self.deferrals("rolled_back"),
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
        }

    def summary_line(self) -> str:
        """One human line: the figures a user looks at first."""
        return (
            f"{self.emitted} tokens in {self.seconds:.2f}s ({self.tokens_per_second:.2f} tok/s), "
            f"{self.num_rounds} rounds, tau {self.tau:.2f}; drafted {self.drafted}: "
            f"accepted {self.accepted}, loosely {self.loosely_accepted}, "
            f"rejected {self.rejected}; drafting {self.draft_seconds:.2f}s, "
            f"verifying {self.verify_seconds:.2f}s, prefill {self.prefill_seconds:.2f}s"
        )


def mean_speedup(
    method_tokens_per_second: Sequence[float], target_tokens_per_second: Sequence[float]
) -> float:
    """Mean per-sample tokens/s of a method over that of the target (nan without a baseline):
    the Spec-Bench convention, shared by ``flyspec bench`` and ``flyspec eval``."""
    if not method_tokens_per_second or not target_tokens_per_second:
        return math.nan
    baseline = statistics.fmean(target_tokens_per_second)
    if baseline <= 0:
        return math.nan
    return statistics.fmean(method_tokens_per_second) / baseline
