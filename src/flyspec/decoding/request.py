"""One request inside the decoding loop: what it carries between rounds (the context, the
tokens emitted, the tokens held for a deferred window, its statistics, its clock) and the named
steps the loop calls on it: the block size, the draft, the commit of a verified round, the
feedback to the drafter and to ``-k auto``, the delivery of the committed tokens.

Internal to :mod:`flyspec.decoding.loop` but for :class:`TokenEvent` and :data:`Origin`."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.auto_k.measure import catch_up
from flyspec.decoding.auto_k.policy import RequestAutoK, largest_block
from flyspec.decoding.drafters import Draft, Drafter
from flyspec.decoding.grammar import RequestGrammar
from flyspec.decoding.logprobs import TokenLogprob, token_logprobs
from flyspec.decoding.penalties import RequestPenalties
from flyspec.decoding.stats import DeferralDecision, LooseToken, RequestStats, RoundStats
from flyspec.decoding.verify import Verdict, loose_token_features, sampling_logits
from flyspec.models.cache import DeviceTokens, LanguageModel

Origin = Literal["exact", "loose", "correction", "bonus"]
"""How an emitted token was obtained: an exactly accepted draft token, a loosely accepted one,
the target's correction at the cut, or the target's bonus token after a fully kept block (with
the target alone every token is a bonus of an empty block)."""


@dataclass(frozen=True)
class TokenEvent:
    """One committed token, yielded as soon as its round is verified; with its
    log-probability where the request asked for them (``logprobs``)."""

    token: int
    origin: Origin
    round_index: int
    logprob: TokenLogprob | None = None


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
class PendingDeferral:
    """A deferred mismatch (``FlyConfig.defer``) carried into the next round, undecided: its
    tokens are in the context but not emitted; the next block's leading exact matches
    confirm them (at least ``need``) or roll them back to the target's ``correction``."""

    tokens: list[int]  # the mismatched draft token, the exact matches after it, the bonus
    origins: list[Origin]
    need: int
    correction: int
    round_index: int
    loose_token: LooseToken
    correction_on_device: torch.Tensor | None = None  # long[1], where the device holds it
    logprobs: tuple[TokenLogprob | None, ...] = ()  # of the tokens, where asked for
    correction_logprob: TokenLogprob | None = None

    def decide(
        self, confirmed: bool, *, eos_token_ids: Collection[int]
    ) -> tuple[DeferralDecision, list[TokenEvent]]:
        """The decision, and the events it emits: the held tokens when ``confirmed``, else
        the correction (none when that ends the request)."""
        if confirmed:
            logprobs = self.logprobs or (None,) * len(self.tokens)
            triples = zip(self.tokens, self.origins, logprobs, strict=True)
            events = [self._event(token, origin, logprob) for token, origin, logprob in triples]
            decision = DeferralDecision(
                confirmed=True,
                exact=len(self.tokens) - 2,
                loose_tokens=(self.loose_token,),
                emitted=len(events),
            )
            return decision, events
        events = []
        if self.correction not in eos_token_ids:
            events = [self._event(self.correction, "correction", self.correction_logprob)]
        decision = DeferralDecision(confirmed=False, exact=0, loose_tokens=(), emitted=len(events))
        return decision, events

    def _event(self, token: int, origin: Origin, logprob: TokenLogprob | None) -> TokenEvent:
        return TokenEvent(token=token, origin=origin, round_index=self.round_index, logprob=logprob)


@dataclass(frozen=True)
class Committed:
    """What committing a round gave: the events to deliver, and whether the request ended."""

    events: list[TokenEvent]
    finished: bool


class Request:
    """One request's state between rounds and the steps the loop calls on it.

    ``context``: the prompt, the emitted tokens and those a ``pending`` deferral holds (what
    the next block drafts after), the list of ``tokens``, which holds them on the device too.
    ``penalties`` and ``grammar``: what changes the target's distribution before verification
    reads it (None: nothing; :meth:`constrain`); a block is also cut where the grammar forbids
    its token.
    ``logprobs``: each emitted token's log-probability is read, with that many alternatives
    (None: none are read). Each round is timed here: drafting in :meth:`draft`, the target's
    forward and the verification from then until :meth:`commit`. ``drafter`` is None for the
    target alone; ``draft_lm`` the built-in drafter's draft model, where it drafts; ``auto``
    is ``-k auto``'s controller, None for a fixed K.

    With ``-k auto`` the draft model reads only what it drafts after: before a block it
    drafts, it first catches up on the context it skipped (:func:`catch_up`), timed apart from
    the per-token drafting cost that chooses the block.
    """

    def __init__(
        self,
        *,
        tokens: DeviceTokens,
        penalties: RequestPenalties | None = None,
        grammar: RequestGrammar | None = None,
        logprobs: int | None = None,
        config: DecodeConfig,
        stats: RequestStats,
        drafter: Drafter | None,
        draft_lm: LanguageModel | None,
        auto: RequestAutoK | None,
        eos_token_ids: Collection[int],
        clock: BusyClock,
    ) -> None:
        self.tokens = tokens
        self.context = tokens.ids
        self.penalties = penalties
        self.grammar = grammar
        self.logprobs = logprobs
        self.config = config
        self.stats = stats
        self.drafter = drafter
        self.draft_lm = draft_lm
        self.auto = auto
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.produced = 0
        self.pending: PendingDeferral | None = None
        self.round_index = 0
        self._settings_kind = "lookup" if config.drafter == "ngram" else "model"
        self._kind = self._settings_kind
        self._catch_up_seconds = 0.0
        self._draft_seconds = 0.0
        self._drafted_at = 0.0

    def room(self) -> int:
        """Tokens the budget has left, held tokens counted as spent."""
        held = 0 if self.pending is None else len(self.pending.tokens)
        return self.config.max_new_tokens - self.produced - held

    def block_size(self, room: int) -> int:
        """K for the next round: the configured one within the budget (the block and its
        correction or bonus fit in ``room``), or ``-k auto``'s choice below that, never fewer
        than the draft tokens a held deferral needs to be decided; a prediction's run may
        go past ``-k`` there (:func:`~flyspec.decoding.auto_k.policy.largest_block`); none in the
        first round of a request whose first token comes alone."""
        if self.drafter is None:
            return 0
        alone = self.round_index == 0 and self.config.first_token_alone
        if self.auto is None:
            return 0 if alone else min(self.config.k, room - 1)
        self._kind = self.drafter.plan(self.context) or self._settings_kind
        limit = 0 if alone else min(largest_block(self.config, self._kind), room - 1)
        return self.auto.choose(
            self._kind, limit, at_least=0 if self.pending is None else self.pending.need
        )

    def catch_up(self, k: int) -> None:
        """Before a block of ``k`` the draft model drafts under ``-k auto``: have it read the
        context it skipped in the rounds it did not draft (:func:`catch_up`), timed apart
        from the per-token drafting cost that chooses the block."""
        self._catch_up_seconds = 0.0
        if self.auto is not None and k > 0 and self._kind == "model" and self.draft_lm is not None:
            self._catch_up_seconds = catch_up(self.draft_lm, self.context)

    def draft(self, k: int) -> Draft:
        """Up to ``k`` draft tokens after the context (none for ``k == 0``), cut before the
        first the grammar forbids, timed."""
        started = time.perf_counter()
        draft = self.drafter.propose(self.context, k) if k > 0 else Draft.empty()
        if self.grammar is not None and len(draft):
            draft = self.grammar.cut(draft)
        self._drafted_at = time.perf_counter()
        self._draft_seconds = self._drafted_at - started
        return draft

    def constrain(self, target_logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """The target's ``[K+1, V]`` logits over ``draft`` as verification reads them:
        penalised, then masked by the grammar (row ``i`` after draft tokens ``0..i-1``)."""
        if self.penalties is not None:
            target_logits = self.penalties.apply(target_logits, block=draft.tokens)
        if self.grammar is not None:
            target_logits = self.grammar.apply(target_logits, block=draft.token_ids)
        return target_logits

    def commit(
        self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor | None
    ) -> Committed:
        """Commit a verified round (``target_logits``: the target's ``[K+1, V]`` logits over
        it; None for a round of the target alone, which keeps nothing loosely) to the context
        and the statistics, final from then on. A round after a deferral first decides it:
        confirmed, the held tokens come first; rolled back, only the correction is emitted
        and the block, drafted after tokens now taken back, keeps nothing. A new deferral
        holds its tokens back for the next round to decide."""
        timing = {
            "draft_seconds": self._draft_seconds + self._catch_up_seconds,
            "verify_seconds": time.perf_counter() - self._drafted_at,
            "source": draft.source if len(draft) else None,
        }
        decision, events = None, []
        if self.pending is not None:
            decision, events = self._decide(self.pending, verdict)
            ends = not decision.confirmed and self.pending.correction in self.eos_token_ids
            self.pending = None
            if not decision.confirmed:
                wasted = RoundStats(
                    drafted=len(draft),
                    accepted=0,
                    loosely_accepted=0,
                    emitted=decision.emitted,
                    ended_by_eos=ends,
                    decided=decision,
                    **timing,
                )
                self.stats.add_round(wasted)
                self.round_index += 1
                return Committed(events, ends)
        if verdict.deferral is not None and not self._can_defer(verdict, draft):
            verdict = verdict.without_deferral()
        finished = self._keep(draft, verdict, target_logits, timing, events, decision)
        self.round_index += 1
        return Committed(events, finished)

    def learn(self, draft: Draft, verdict: Verdict) -> None:
        """Feedback of the committed round: to a drafter that adapts to what is kept, and to
        ``-k auto`` (the round's costs, and the acceptance of the blocks now decided)."""
        if len(draft):
            self.drafter.observe(len(draft), verdict.num_kept)
        if self.auto is not None:
            self.auto.learn(
                self.stats.rounds,
                drafted=len(draft),
                draft_seconds=self._draft_seconds,
                verify_seconds=self.stats.rounds[-1].verify_seconds,
            )

    def deliver(self, committed: Committed) -> Iterator[TokenEvent]:
        """Yield a round's events, the clock paused while the caller holds them; when the
        caller stops early, the tokens it never received are counted as undelivered."""
        events = committed.events
        for delivered, event in enumerate(events, start=1):
            self.clock.pause()
            try:
                yield event
            except GeneratorExit:
                self.stats.undelivered += len(events) - delivered
                self.stats.finish_reason = "cancelled"
                raise
            self.clock.resume()

    def _decide(
        self, pending: PendingDeferral, verdict: Verdict
    ) -> tuple[DeferralDecision, list[TokenEvent]]:
        """Decide ``pending`` by this round's leading exact matches: confirmed, its tokens
        are emitted; rolled back, they leave the context for the target's correction."""
        confirmed = verdict.num_leading_exact >= pending.need
        decision, events = pending.decide(confirmed, eos_token_ids=self.eos_token_ids)
        self.produced += len(events)
        if not confirmed:
            self.tokens.truncate(len(self.context) - len(pending.tokens))
            self.tokens.extend(
                [event.token for event in events],
                on_device=pending.correction_on_device if events else None,
            )
        return decision, events

    def _can_defer(self, verdict: Verdict, draft: Draft) -> bool:
        """Whether a deferred window can be decided by the next block: no end-of-sequence
        token among the held tokens, and budget left for ``need`` draft tokens after them."""
        deferral = verdict.deferral
        held = draft.token_ids[deferral.position :] + [verdict.next_token]
        if self.drafter is None or any(token in self.eos_token_ids for token in held):
            return False
        remaining = self.config.max_new_tokens - self.produced - deferral.position - len(held)
        return deferral.need <= min(self.config.k, remaining - 1)

    def _keep(
        self,
        draft: Draft,
        verdict: Verdict,
        target_logits: torch.Tensor | None,
        timing: dict,
        events: list[TokenEvent],
        decision: DeferralDecision | None,
    ) -> bool:
        """Commit the block's kept tokens and the target's own token up to an end-of-sequence
        token or a deferral (whose tokens are held back), count the round (with the
        ``decision`` on the deferral before it, whose ``events`` come first), and add its
        events to ``events``. Whether the request ended."""
        deferral = verdict.deferral
        records = loose_records(
            verdict, draft, target_logits, entropy=self.config.fly.entropy, produced=self.produced
        )
        tokens = draft.token_ids[: verdict.num_kept] + [verdict.next_token]
        on_device = verdict.tokens_on_device()  # the same tokens, where the device chose them
        logprobs, correction_logprob = self._logprobs(tokens, on_device, verdict, target_logits)
        origins: list[Origin] = [
            "loose" if i in verdict.loose_positions else "exact" for i in range(verdict.num_kept)
        ] + ["bonus" if verdict.is_bonus else "correction"]
        if deferral is not None:
            origins[deferral.position] = "loose"
        cut = len(tokens) if deferral is None else deferral.position
        emitted = next(
            (i for i, token in enumerate(tokens[:cut]) if token in self.eos_token_ids), cut
        )
        finished = emitted < cut
        self.stats.add_round(
            RoundStats(
                drafted=len(draft),
                accepted=min(verdict.num_kept, cut) - verdict.num_loose,
                loosely_accepted=verdict.num_loose,
                emitted=len(events) + emitted,
                ended_by_eos=finished,
                deferred=deferral is not None and not finished,
                decided=decision,
                loose_tokens=tuple(records[i] for i in verdict.loose_positions),
                **timing,
            )
        )
        held = deferral is not None and not finished
        if held:
            self.pending = PendingDeferral(
                tokens=tokens[cut:],
                origins=origins[cut:],
                need=deferral.need,
                correction=deferral.correction,
                round_index=self.round_index,
                loose_token=records[deferral.position],
                correction_on_device=verdict.correction_on_device(),
                logprobs=tuple(logprobs[cut:]),
                correction_logprob=correction_logprob,
            )
        # The context goes on with the emitted tokens, and the held ones after them.
        length = len(tokens) if held else emitted
        self.tokens.extend(tokens[:length], None if on_device is None else on_device[:length])
        triples = zip(tokens[:emitted], origins[:emitted], logprobs[:emitted], strict=True)
        events += [
            TokenEvent(token, origin, self.round_index, logprob)
            for token, origin, logprob in triples
        ]
        self.produced += emitted
        return finished

    def _logprobs(
        self,
        tokens: list[int],
        on_device: torch.Tensor | None,
        verdict: Verdict,
        target_logits: torch.Tensor | None,
    ) -> tuple[list[TokenLogprob | None], TokenLogprob | None]:
        """The round's tokens' log-probabilities (token ``i`` at row ``i`` of the target's
        logits, as verification read them; ``on_device``: the tokens on the device, where it
        holds them) and a deferral's correction's; Nones where the request asked for none."""
        if self.logprobs is None or target_logits is None:
            return [None] * len(tokens), None
        logits = target_logits
        if not self.config.sampling.greedy:
            logits = sampling_logits(target_logits, self.config.sampling)
        rows = logits[: len(tokens)]
        chosen = on_device
        if chosen is None:
            chosen = torch.tensor(tokens, device=logits.device)
        deferral = verdict.deferral
        if deferral is not None:  # and its correction, at the deferred position
            correction = verdict.correction_on_device()
            if correction is None:
                correction = torch.tensor([deferral.correction], device=logits.device)
            rows = torch.cat((rows, logits[deferral.position : deferral.position + 1]))
            chosen = torch.cat((chosen.to(logits.device), correction.to(logits.device)))
        records = token_logprobs(rows, chosen, top=self.logprobs)
        if deferral is not None:
            return records[:-1], records[-1]
        return records, None


def loose_records(
    verdict: Verdict,
    draft: Draft,
    target_logits: torch.Tensor | None,
    *,
    entropy: str,
    produced: int,
) -> dict[int, LooseToken]:
    """A :class:`LooseToken` for every loosely kept (or deferred) position of the block,
    read from the target's ``[K+1, V]`` logits; ``produced``: tokens emitted before it."""
    positions = list(verdict.loose_positions)
    if verdict.deferral is not None:
        positions.append(verdict.deferral.position)
    if not positions:
        return {}
    if verdict.position_features is not None:  # read with the verdict
        columns = {
            name: [values[position] for position in positions]
            for name, values in verdict.position_features.items()
        }
        ids = draft.token_ids
        columns["draft_token"] = [ids[position] for position in positions]
    else:
        columns = _read_features(draft, target_logits, positions, entropy=entropy)
    return {
        position: LooseToken(
            output_index=produced + position,
            position=position,
            block_size=len(draft),
            deferred=verdict.deferral is not None and position == verdict.deferral.position,
            draft_token=int(columns["draft_token"][row]),
            target_token=int(columns["target_token"][row]),
            entropy=columns["entropy"][row],
            draft_prob=columns["draft_prob"][row],
            top_prob=columns["top_prob"][row],
            ratio=columns["ratio"][row],
            rank=int(columns["rank"][row]),
            draft_confidence=columns.get("draft_confidence", [None] * len(positions))[row],
        )
        for row, position in enumerate(positions)
    }


def _read_features(
    draft: Draft, target_logits: torch.Tensor, positions: list[int], *, entropy: str
) -> dict[str, list[float]]:
    """:func:`loose_token_features` of the block's ``positions`` (and the draft's token and
    confidence there), read from the device: one read for them all."""
    index = torch.tensor(positions, device=target_logits.device)
    draft_tokens = draft.tokens.to(target_logits.device)[index]
    features = loose_token_features(target_logits[index], draft_tokens, entropy=entropy)
    if draft.confidence is not None:
        features["draft_confidence"] = draft.confidence.to(target_logits.device)[index]
    features["draft_token"] = draft_tokens
    # float64 holds the token ids and ranks exactly.
    rows = torch.stack([values.double() for values in features.values()]).tolist()
    return dict(zip(features, rows, strict=True))
