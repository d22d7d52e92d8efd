"""``-k auto``'s policy: from the forward costs and the acceptance seen so far, the K of the
next round. Pure arithmetic on numbers it is given: it runs no model and reads no file (the
costs come from :mod:`~flyspec.decoding.auto_k.measure`, kept by
:mod:`~flyspec.decoding.auto_k.store`)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from flyspec.config import LONG_BLOCK
from flyspec.decoding.stats import DeferralDecision, RoundStats

PROBE_AFTER = 16
"""Rounds of the target alone after which one round drafts again, to refresh the rates."""
PRIOR_RATE = 0.7
"""The prior chance that a draft position is kept, before any round is seen (optimistic, so
that drafting is tried)."""
PRIOR_WEIGHT = 2.0
"""How many observations the prior counts for, per position."""
DECAY = 0.95
"""Each round's weight in the running rates shrinks by this factor per later round."""
PLAUSIBLE_RATE = 0.95
"""The acceptance per position a probe must be able to profit from; above what FLy keeps on the
default pair at K=15 (88-94% of draft tokens)."""
COST_SMOOTHING = 0.3
"""Weight of a newly measured forward or drafting time in the running cost."""


def largest_block(config, kind: str) -> int:
    """The largest K ``-k auto`` may choose for a block of ``kind`` under ``config`` (a
    :class:`~flyspec.config.DecodeConfig`): ``config.k``, or :data:`LONG_BLOCK` for a
    prediction's run where that is larger."""
    return max(config.k, LONG_BLOCK) if kind == "prediction" else config.k


def expected_tokens(p: Sequence[float]) -> float:
    """Tokens a round commits on average when ``p[i]`` is the chance that position ``i + 1``
    is kept once the ones before it were: ``1 + sum_j prod_{i<=j} p_i`` (the final 1 is the
    target's own token, a correction or a bonus)."""
    total, survive = 1.0, 1.0
    for rate in p:
        survive *= rate
        total += survive
    return total


@dataclass
class ForwardCosts:
    """Seconds of one target forward over n tokens: a table measured at a few n (interpolated
    linearly between them, extended along the last segment beyond), times a running scale
    that follows the forwards measured since. The table keeps the machine's ratio of a block
    to one token; the scale follows what changes all forwards alike (a growing context)."""

    seconds: dict[int, float]
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.seconds or min(self.seconds) < 1:
            raise ValueError("forward costs need at least one size n >= 1")

    def __call__(self, n: int) -> float:
        return self.scale * self.measured(n)

    def measured(self, n: int) -> float:
        """The measured table at ``n``, interpolated."""
        sizes = sorted(self.seconds)
        if n in self.seconds:
            return self.seconds[n]
        if len(sizes) == 1:
            return self.seconds[sizes[0]] * n / sizes[0]
        at = bisect.bisect_left(sizes, n)
        low, high = (
            (sizes[0], sizes[1])
            if at == 0
            else (sizes[-2], sizes[-1])
            if at == len(sizes)
            else (sizes[at - 1], sizes[at])
        )
        slope = (self.seconds[high] - self.seconds[low]) / (high - low)
        return max(self.seconds[low] + slope * (n - low), 1e-9)

    def observe(self, n: int, seconds: float) -> None:
        """Fold in a measured forward over ``n`` tokens."""
        if seconds > 0:
            ratio = seconds / self.measured(n)
            self.scale = (1 - COST_SMOOTHING) * self.scale + COST_SMOOTHING * ratio


@dataclass
class AutoK:
    """Running estimates and the block size they choose, shared by the requests of one set of
    settings (what one request learns, the next starts from).

    ``max_k``: the largest block; ``window``: FLy's deferred window (None for lossless
    decoding, whose positions are kept exactly or not at all); ``defer``: FLy's deferral
    (a window may then run past the block); ``draft_seconds``: the first estimate of ``d``.

    Per draft position ``i`` it counts the rounds that reached it (``reached``), kept it
    exactly (``exact``), and, among the rounds where a loose keep was possible there (the
    window fit in the block: ``loose_possible``), kept it loosely (``loose``). Costs are
    learnt from every round (:meth:`observe_costs`), acceptance from each block once it is
    decided (:meth:`observe_block`).
    """

    max_k: int
    costs: ForwardCosts
    window: int | None = None
    defer: bool = False
    draft_seconds: float = 0.0
    reached: list[float] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)
    loose_possible: list[float] = field(default_factory=list)
    loose: list[float] = field(default_factory=list)
    plain_rounds: int = 0
    probe_after: int = PROBE_AFTER

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        self.reached = [0.0] * self.max_k
        self.exact = [0.0] * self.max_k
        self.loose_possible = [0.0] * self.max_k
        self.loose = [0.0] * self.max_k

    def window_fits(self, position: int, k: int) -> bool:
        """Whether FLy can keep the 0-based draft ``position`` loosely in a block of ``k``:
        its window of W further tokens fits in the block, or deferral carries it over."""
        return self.window is not None and (self.defer or position + 1 + self.window <= k)

    def rates(self, k: int) -> list[float]:
        """``p_i(k)`` for i = 1..k: each position's running exact rate, plus its loose rate
        where FLy's window fits in a block of ``k``."""
        exact_prior, loose_prior = self._pooled()
        rates = []
        for i in range(k):
            exact = (self.exact[i] + PRIOR_WEIGHT * exact_prior) / (self.reached[i] + PRIOR_WEIGHT)
            loose = (self.loose[i] + PRIOR_WEIGHT * loose_prior) / (
                self.loose_possible[i] + PRIOR_WEIGHT
            )
            rates.append(min(exact + (loose if self.window_fits(i, k) else 0.0), 1.0))
        return rates

    def _pooled(self) -> tuple[float, float]:
        """The exact and loose rates over all positions (the prior of each position)."""
        exact_share = PRIOR_RATE if self.window is None else PRIOR_RATE * 0.8
        exact = (sum(self.exact) + PRIOR_WEIGHT * exact_share) / (sum(self.reached) + PRIOR_WEIGHT)
        if self.window is None:
            return exact, 0.0
        loose_share = PRIOR_RATE - exact_share
        loose = (sum(self.loose) + PRIOR_WEIGHT * loose_share) / (
            sum(self.loose_possible) + PRIOR_WEIGHT
        )
        return exact, loose

    def tokens_per_second(self, k: int) -> float:
        """Expected tokens per second of a round that drafts ``k`` tokens."""
        return expected_tokens(self.rates(k)) / (k * self.draft_seconds + self.costs(k + 1))

    def choose(self, limit: int | None = None, *, at_least: int = 0) -> int:
        """The block size of the next round, at most ``limit`` (the budget left) and at least
        ``at_least`` (the draft tokens that decide a deferred window: fewer would always
        roll it back)."""
        top = self.max_k if limit is None else max(0, min(self.max_k, limit))
        low = min(at_least, top)
        if top == 0:
            return 0
        best = max(range(low, top + 1), key=self.tokens_per_second)
        if best > 0:
            self.probe_after = PROBE_AFTER  # drafting pays again: probe promptly when it stops
        elif self.plain_rounds >= self.probe_after and self.could_pay(top):
            self.probe_after *= 2
            best = max(range(1, top + 1), key=self.tokens_per_second)
        return best

    def could_pay(self, top: int) -> bool:
        """Whether some block of at most ``top`` would beat the target alone were draft
        tokens kept at :data:`PLAUSIBLE_RATE`: where not (a compute-bound forward with a slow
        draft), no acceptance seen in practice makes drafting pay, and a probe (which first
        has the draft model read the context it skipped) would only cost."""
        plain = 1 / self.costs(1)
        return any(
            expected_tokens([PLAUSIBLE_RATE] * k) / (k * self.draft_seconds + self.costs(k + 1))
            > plain
            for k in range(1, top + 1)
        )

    def observe_costs(
        self, *, drafted: int, draft_seconds: float = 0.0, verify_seconds: float = 0.0
    ) -> None:
        """Fold in one round's drafting time (``drafted`` tokens) and verifying time."""
        if drafted == 0:
            self.plain_rounds += 1
        else:
            self.plain_rounds = 0
            self.draft_seconds = _smooth(self.draft_seconds, draft_seconds / drafted)
        self.costs.observe(drafted + 1, verify_seconds)

    def observe_acceptance(
        self, *, drafted: int, kept: int, loose_positions: Iterable[int] = ()
    ) -> None:
        """Fold in which of ``drafted`` tokens were kept: the first ``kept``, those at the
        0-based ``loose_positions`` loosely."""
        if drafted == 0:
            return
        for rates in (self.reached, self.exact, self.loose_possible, self.loose):
            rates[:] = [DECAY * value for value in rates]
        loose = set(loose_positions)
        for i in range(min(kept + 1, drafted, self.max_k)):
            self.reached[i] += 1
            self.loose_possible[i] += self.window_fits(i, drafted)
            if i < kept:
                (self.loose if i in loose else self.exact)[i] += 1

    def observe_block(
        self, round_stats: RoundStats, decision: DeferralDecision | None = None
    ) -> None:
        """Fold in a committed round's acceptance; for a round that deferred, with the
        ``decision`` the next round made on it (the held tokens it kept count as kept)."""
        kept = round_stats.kept
        loose = [token.position for token in round_stats.loose_tokens]
        if decision is not None:
            kept += decision.kept
            loose += [token.position for token in decision.loose_tokens]
        self.observe_acceptance(drafted=round_stats.drafted, kept=kept, loose_positions=loose)


@dataclass
class AutoKPolicies:
    """What ``-k auto`` learns, kept across requests: the target's forward costs
    (``block_costs``, measured by :func:`~flyspec.decoding.auto_k.measure.measure_costs`),
    the draft model's seconds per token, and one :class:`AutoK` per set of settings and kind
    of block (``model``, ``lookup``, ``prediction``, ... as the drafter's
    ``plan`` names them: blocks of different kinds cost and keep differently)."""

    block_costs: ForwardCosts | None = None
    draft_token_seconds: float = 0.0
    policies: dict[tuple, AutoK] = field(default_factory=dict)

    def policy(self, config, kind: str) -> AutoK:
        """The policy of ``config``'s settings (a :class:`~flyspec.config.DecodeConfig`) for
        blocks of ``kind``; only blocks of the draft model cost drafting time."""
        if self.block_costs is None:
            raise RuntimeError("the target's forward costs are not measured yet")
        fly = config.fly_in_force
        key = (config.mode, config.drafter, config.k, fly, kind)
        if key not in self.policies:
            self.policies[key] = AutoK(
                max_k=largest_block(config, kind),
                costs=self.block_costs,
                window=None if fly is None else fly.window,
                defer=fly is not None and fly.defer,
                draft_seconds=self.draft_token_seconds if kind == "model" else 0.0,
            )
        policy = self.policies[key]
        policy.costs = self.block_costs
        return policy


class RequestAutoK:
    """``-k auto``'s controller within one request: before each round, the policy of the kind
    of block the next round drafts (``model``, ``lookup``, ``prediction``, ...: the loop
    says which) chooses K; after it, that policy learns the round's costs and its block's
    acceptance. A deferring round's acceptance is learnt once the next round has decided
    it, by the policy that chose its block; the block of a round that rolled a deferral back
    (drafted after tokens taken back) teaches nothing.
    """

    def __init__(self, policies: AutoKPolicies, config) -> None:
        self.policies = policies
        self.config = config
        self._policy: AutoK | None = None
        self._deferring: AutoK | None = None  # the policy that chose a deferring round's block

    def choose(self, kind: str, limit: int, *, at_least: int = 0) -> int:
        """K for the next round, a block of ``kind`` (at most ``limit``, at least
        ``at_least``)."""
        self._policy = self.policies.policy(self.config, kind)
        return self._policy.choose(limit, at_least=at_least)

    def learn(
        self,
        rounds: Sequence[RoundStats],
        *,
        drafted: int,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        """The last of ``rounds`` was committed after drafting ``drafted`` tokens in
        ``draft_seconds`` (the catch-up left out) and verifying them in ``verify_seconds``."""
        self._policy.observe_costs(
            drafted=drafted, draft_seconds=draft_seconds, verify_seconds=verify_seconds
        )
        last = rounds[-1]
        if not last.deferred and (last.decided is None or last.decided.confirmed):
            self._policy.observe_block(last)
        if last.decided is not None and self._deferring is not None:
            self._deferring.observe_block(rounds[-2], last.decided)
        self._deferring = self._policy if last.deferred else None


def _smooth(before: float, measured: float) -> float:
    return measured if before <= 0 else (1 - COST_SMOOTHING) * before + COST_SMOOTHING * measured


def probe_sizes(max_n: int, *, room: int | None = None) -> list[int]:
    """The forward sizes measured before a request's first round: powers of two up to
    ``max_n``, and ``max_n``; none above ``room`` (the largest forward that fits the model's
    context after the request's context: sizes beyond are extrapolated from the table)."""
    top = max_n if room is None else max(1, min(max_n, room))
    sizes, n = [], 1
    while n < top:
        sizes.append(n)
        n *= 2
    return [*sizes, top]
