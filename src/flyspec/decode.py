"""The decoding loop: draft -> one target forward -> verify -> commit -> repeat.

Caches are never cropped by hand here: :class:`~flyspec.models.cache.CachedLM` is always
given the committed sequence and drops whatever it cached beyond the common prefix, which is
exactly the rejected part of the last block.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Iterator, Sequence

import torch

from flyspec.auto_k import (
    AutoKPolicies,
    ForwardCosts,
    RequestAutoK,
    measure_block_costs,
    probe_sizes,
)
from flyspec.config import DecodeConfig
from flyspec.decode_state import (
    BusyClock,
    Held,
    Origin,
    Progress,
    Round,
    TokenEvent,
    deliver,
)
from flyspec.drafters import Draft, Drafter, make_drafter
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM, LanguageModel, common_prefix_length
from flyspec.stats import LooseToken, RequestStats, RoundStats
from flyspec.verify import (
    Verdict,
    loose_token_features,
    sampling_logits,
    verify_greedy,
    verify_sampling,
)

__all__ = [
    "DECODER_REVISION",
    "Origin",
    "SpeculativeDecoder",
    "TokenEvent",
    "budget_margin",
    "text_settings",
]

DECODER_REVISION = 3
"""The revision of what the decoder emits. Bump it with every change that can alter the
tokens emitted for some :class:`DecodeConfig` (verification, drafting, where blocks are cut
near the budget or an end-of-sequence token): caches of generated text key on it, so no
cached text outlives the code that produced it."""

_SPECULATION_SETTINGS = ("drafter", "k", "fly", "draft_temperature", "draft_confidence", "auto_k")
_DRAFTING_SETTINGS = ("max_ngram", "mla_proposals")


def text_settings(config: DecodeConfig) -> dict:
    """The settings of ``config`` that the emitted tokens depend on, as plain data: all of
    them but the token budget (see :func:`budget_margin`), less those the mode ignores (the
    target alone drafts nothing; exact speculative decoding has no FLy rule)."""
    settings = dataclasses.asdict(config)
    settings.pop("max_new_tokens")
    if not config.auto_k:
        settings.pop("auto_k")
    if config.fly_in_force is None or not config.loosen_predicted:
        settings.pop("loosen_predicted")
    settings["stop"] = list(config.stop)
    if config.mode == "target":
        for name in _SPECULATION_SETTINGS + _DRAFTING_SETTINGS:
            settings.pop(name, None)
    elif config.fly_in_force is None:
        settings.pop("fly")
    return settings


def budget_margin(config: DecodeConfig) -> int:
    """How far before the token budget a greedy request must have ended for its tokens not to
    depend on the budget: 0 for the target alone and exact speculative decoding (the target's
    greedy tokens whatever the blocks); ``k + 1`` for FLy, whose last blocks are shortened to
    fit the budget, which changes where a window fits; twice that with deferral, whose held
    tokens and next block must fit as well."""
    if config.fly_in_force is None:
        return 0
    return (config.k + 1) * (2 if config.fly_in_force.defer else 1)


class SpeculativeDecoder:
    """Runs requests on one target model and an optional draft model (batch size 1).

    Each model is a torch module (run by :class:`~flyspec.models.cache.CachedLM`) or any
    :class:`~flyspec.models.cache.LanguageModel`, such as a llama.cpp model
    (:class:`~flyspec.models.llamacpp.LlamaCppLM`).

    ``eos_token_ids``: tokens that end a request; they are not emitted. ``forward_path``:
    ``lean`` (the default, where the architecture allows) or ``transformers``
    (:func:`flyspec.models.cache.make_forward`).
    """

    def __init__(
        self,
        target: torch.nn.Module | LanguageModel,
        draft: torch.nn.Module | LanguageModel | None = None,
        *,
        eos_token_ids: Collection[int] = (),
        forward_path: str = "lean",
    ) -> None:
        self.target = _language_model(target, forward_path)
        self.draft = _language_model(draft, forward_path) if draft is not None else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.auto_k = AutoKPolicies()  # what -k auto learns, across requests
        self.vocab_size = self.target.vocab_size

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        stats: RequestStats | None = None,
        drafter: Drafter | None = None,
        prediction: Sequence[int] | None = None,
    ) -> Iterator[TokenEvent]:
        """Yield committed tokens until ``max_new_tokens`` or EOS; never more.

        ``stats`` (optional) is filled in as the request runs. The caller may stop iterating at
        any time (a stop string, a disconnect); nothing past that point is computed.
        ``drafter``: any :class:`~flyspec.drafters.Drafter` instead of the built-in one
        ``config.drafter`` names (not in mode ``target``, which drafts nothing).
        ``prediction``: token ids the answer is expected to largely repeat (Predicted
        Outputs): blocks come from it where the answer follows it, else from the built-in
        drafter (:class:`~flyspec.drafters.prediction.PredictionDrafter`); mode ``target``
        drafts nothing and ignores it.
        """
        if len(prompt_ids) == 0:
            raise FlyspecError("the prompt is empty: give at least one token")
        stats = stats if stats is not None else RequestStats()
        stats.prompt_tokens = len(prompt_ids)
        if drafter is not None and config.mode == "target":
            raise FlyspecError("mode 'target' drafts nothing: give a drafter with spd or fly")
        if drafter is not None and prediction is not None:
            raise FlyspecError("give a drafter or a prediction, not both")
        if prediction is not None and len(prediction) == 0:
            raise FlyspecError("the prediction is empty: give at least one token, or none")
        target_generator = _generator(self.target.device, config)
        own_drafter = drafter is None
        if own_drafter:
            draft_generator = None
            if self.draft is not None and config.draft_temperature > 0:
                draft_generator = _generator(self.draft.device, config, offset=1)
            drafter = make_drafter(
                config,
                draft_lm=self.draft,
                end_tokens=self.eos_token_ids,
                generator=draft_generator,
                prediction=prediction,
                prompt_length=len(prompt_ids),
            )
        observe = getattr(drafter, "observe", None)
        clock = BusyClock()

        self.target.reset()
        if drafter is not None:
            drafter.reset()
        progress = Progress(context=list(prompt_ids))
        # Prefill everything but the last prompt token: each round feeds the last committed
        # token together with the draft block.
        if len(prompt_ids) > 1:
            self.target.logits(progress.context[:-1])
            # With -k auto the draft model reads the prompt only once it first drafts (maybe
            # never); its cache catches up by itself then.
            if own_drafter and config.uses_draft_model and not config.auto_k and not prediction:
                self.draft.logits(progress.context[:-1])
        stats.prefill_seconds = clock.elapsed()
        auto = None
        if config.auto_k and drafter is not None:
            self._measure_auto_costs(progress.context, config, measure_draft=own_drafter)
            auto = RequestAutoK(self.auto_k, config, plan=getattr(drafter, "plan", None))

        try:
            while progress.produced + progress.held_length < config.max_new_tokens:
                remaining = config.max_new_tokens - progress.produced - progress.held_length
                k = 0 if drafter is None else min(config.k, remaining - 1)
                catch_up = 0.0
                if auto is not None:
                    held_need = 0 if progress.held is None else progress.held.need
                    k = auto.choose(progress.context, k, at_least=held_need)
                    if k > 0 and own_drafter and auto.kind == "model" and config.uses_draft_model:
                        catch_up = self._catch_up_draft(progress.context)
                step = self._round(progress.context, drafter, k, config, target_generator)
                if observe is not None and len(step.draft):
                    observe(len(step.draft), step.verdict.num_kept)
                if auto is not None:
                    auto.observe_costs(
                        drafted=len(step.draft),
                        draft_seconds=step.draft_seconds,
                        verify_seconds=step.verify_seconds,
                    )
                    step = dataclasses.replace(step, draft_seconds=step.draft_seconds + catch_up)
                deferring_slot = None if progress.held is None else progress.held.round_slot
                events, finished = self._commit(step, progress, config, drafter, stats)
                if auto is not None:  # acceptance as committed: a deferral once it is settled
                    auto.observe_committed(stats.rounds, settled=deferring_slot)
                yield from deliver(events, stats, clock)
                if finished:
                    stats.finish_reason = "stop"
                    return
                progress.round_index += 1
            stats.finish_reason = "length"
        finally:
            clock.resume()
            stats.seconds = clock.elapsed()

    def _catch_up_draft(self, context: list[int]) -> float:
        """With -k auto the draft model reads only what it drafts after: before a block, it
        reads the context it has not seen (the prompt, the rounds of the target alone). Its
        seconds, kept out of the per-token drafting cost that chooses the block. A draft at
        most two positions behind (after a drafting round: the correction, or the last draft
        token and the bonus) reads them in its first drafting forward, as with a fixed K."""
        unseen = len(context) - common_prefix_length(self.draft.cached_tokens, context)
        if unseen <= 2:
            return 0.0
        started = time.perf_counter()
        self.draft.logits(context[:-1])
        return time.perf_counter() - started

    def _measure_auto_costs(
        self, context: list[int], config: DecodeConfig, *, measure_draft: bool
    ) -> None:
        """What ``-k auto`` chooses from, measured once and kept (what one request learns, the
        next starts from): the target's forward costs on the first request's context (and for
        sizes not yet measured), refined by every round since; the draft model's cost per
        token."""
        largest = min(config.k, config.max_new_tokens - 1) + 1
        room = self.target.context_length
        sizes = probe_sizes(largest, room=None if room is None else room - len(context) + 1)
        known = {} if self.auto_k.block_costs is None else self.auto_k.block_costs.seconds
        if not set(sizes) <= set(known):
            # Twice over, keeping the faster: the first forwards of a process may run cold.
            first = measure_block_costs(self.target, context, sizes)
            second = measure_block_costs(self.target, context, sizes)
            known = {**known, **{n: min(first[n], second[n]) for n in sizes}}
            self.auto_k.block_costs = ForwardCosts(known)
        if measure_draft and config.uses_draft_model and self.auto_k.draft_token_seconds == 0:
            self._catch_up_draft(context)
            self.auto_k.draft_token_seconds = measure_block_costs(self.draft, context, [1])[1]

    def _round(
        self,
        context: list[int],
        drafter: Drafter | None,
        k: int,
        config: DecodeConfig,
        generator: torch.Generator | None,
    ) -> Round:
        """Draft up to ``k`` tokens after ``context`` and verify them in one target forward."""
        round_start = time.perf_counter()
        draft = drafter.propose(context, k) if k > 0 else Draft.empty()
        draft_done = time.perf_counter()
        verdict, target_logits = self._verify(context, draft, config, generator)
        return Round(
            draft=draft,
            verdict=verdict,
            target_logits=target_logits,
            draft_seconds=draft_done - round_start,
            verify_seconds=time.perf_counter() - draft_done,
        )

    def _commit(
        self,
        step: Round,
        progress: Progress,
        config: DecodeConfig,
        drafter: Drafter | None,
        stats: RequestStats,
    ) -> tuple[list[tuple[TokenEvent, int]], bool]:
        """Commit a verified round to the context and the statistics: the events to deliver
        (each with the index of the round statistics it counts in) and whether the request
        ended. A round after a deferral first settles it: confirmed, the held tokens come
        first; rolled back, the round is wasted and only the correction is committed."""
        draft, verdict = step.draft, step.verdict
        timing = {
            "draft_seconds": step.draft_seconds,
            "verify_seconds": step.verify_seconds,
            "source": draft.source if len(draft) else None,
        }
        events: list[tuple[TokenEvent, int]] = []
        held = progress.held
        if held is not None:
            progress.held = None
            confirmed = verdict.num_leading_exact >= held.need
            events = held.resolve(confirmed, stats, eos_token_ids=self.eos_token_ids)
            progress.produced += len(events)
            if not confirmed:
                del progress.context[len(progress.context) - len(held.tokens) :]
                progress.context.extend(event.token for event, _ in events)
                wasted = RoundStats(
                    drafted=len(draft),
                    accepted=0,
                    loosely_accepted=0,
                    emitted=0,
                    deferral="wasted",
                    **timing,
                )
                stats.add_round(wasted)
                return events, held.correction in self.eos_token_ids

        deferral = verdict.deferral
        if deferral is not None and not self._can_defer(
            verdict, draft, config, progress.produced, drafter
        ):
            verdict = verdict.without_deferral()
            deferral = None
        records = self._loose_records(verdict, draft, step.target_logits, config, progress.produced)
        tokens = draft.tokens[: verdict.num_kept].tolist() + [verdict.next_token]
        origins: list[Origin] = [
            "loose" if i in verdict.loose_positions else "exact" for i in range(verdict.num_kept)
        ] + ["bonus" if verdict.is_bonus else "correction"]
        if deferral is not None:
            origins[deferral.position] = "loose"
        cut = len(tokens) if deferral is None else deferral.position
        emitted = 0
        finished = False
        for token in tokens[:cut]:
            if token in self.eos_token_ids:
                finished = True
                break
            progress.context.append(token)
            emitted += 1
        stats.add_round(
            RoundStats(
                drafted=len(draft),
                accepted=min(verdict.num_kept, cut) - verdict.num_loose,
                loosely_accepted=verdict.num_loose,
                emitted=emitted,
                ended_by_eos=finished,
                deferral=None if deferral is None else "pending",
                loose_tokens=tuple(records[i] for i in verdict.loose_positions),
                **timing,
            )
        )
        slot = len(stats.rounds) - 1
        if deferral is not None and not finished:
            progress.held = Held(
                tokens=tokens[cut:],
                origins=origins[cut:],
                need=deferral.need,
                correction=deferral.correction,
                round_index=progress.round_index,
                round_slot=slot,
                loose_token=records[deferral.position],
            )
            progress.context.extend(progress.held.tokens)
        events += [
            (TokenEvent(token=token, origin=origin, round_index=progress.round_index), slot)
            for token, origin in zip(tokens[:emitted], origins[:emitted], strict=True)
        ]
        progress.produced += emitted
        return events, finished

    def _can_defer(
        self,
        verdict: Verdict,
        draft: Draft,
        config: DecodeConfig,
        produced: int,
        drafter: Drafter | None,
    ) -> bool:
        """Whether a deferred window can be decided by the next block: no end-of-sequence
        token among the held tokens, and budget left for ``need`` draft tokens after them."""
        deferral = verdict.deferral
        held = draft.tokens[deferral.position :].tolist() + [verdict.next_token]
        if drafter is None or any(token in self.eos_token_ids for token in held):
            return False
        remaining = config.max_new_tokens - produced - deferral.position - len(held)
        return deferral.need <= min(config.k, remaining - 1)

    def _loose_records(
        self,
        verdict: Verdict,
        draft: Draft,
        target_logits: torch.Tensor,
        config: DecodeConfig,
        produced: int,
    ) -> dict[int, LooseToken]:
        """A :class:`LooseToken` for every loosely kept (or deferred) position of the block."""
        positions = list(verdict.loose_positions)
        if verdict.deferral is not None:
            positions.append(verdict.deferral.position)
        if not positions:
            return {}
        index = torch.tensor(positions, device=target_logits.device)
        draft_tokens = draft.tokens.to(target_logits.device)[index]
        features = loose_token_features(
            target_logits[index], draft_tokens, entropy=config.fly.entropy
        )
        columns = {name: values.tolist() for name, values in features.items()}
        return {
            position: LooseToken(
                output_index=produced + position,
                position=position,
                block_size=len(draft),
                deferred=verdict.deferral is not None and position == verdict.deferral.position,
                draft_token=int(draft_tokens[row]),
                target_token=int(columns["target_token"][row]),
                entropy=float(columns["entropy"][row]),
                draft_prob=float(columns["draft_prob"][row]),
                top_prob=float(columns["top_prob"][row]),
                ratio=float(columns["ratio"][row]),
                rank=int(columns["rank"][row]),
                draft_confidence=(
                    None if draft.confidence is None else float(draft.confidence[position])
                ),
            )
            for row, position in enumerate(positions)
        }

    def _verify(
        self,
        context: list[int],
        draft: Draft,
        config: DecodeConfig,
        generator: torch.Generator | None,
    ) -> tuple[Verdict, torch.Tensor]:
        """One target forward over the block and the verdict on it, with the target's
        ``[K+1, V]`` logits (what the loose-token records read). Tokens drafted from a
        prediction are verified exactly unless ``config.loosen_predicted``."""
        target_logits = self.target.logits(context + draft.tokens.tolist(), len(draft) + 1)
        draft_tokens = draft.tokens.to(target_logits.device)
        fly = config.fly_in_force
        if draft.source == "prediction" and not config.loosen_predicted:
            fly = None
        if config.sampling.greedy:
            verdict = verify_greedy(
                draft_tokens,
                target_logits,
                fly=fly,
                draft_confidence=draft.confidence,
            )
            return verdict, target_logits
        verified_logits = sampling_logits(target_logits, config.sampling)
        target_probs = verified_logits.softmax(dim=-1)
        draft_probs = draft.probs
        if draft_probs is not None:
            draft_probs = _resize_vocab(draft_probs.to(target_probs.device), target_probs.shape[-1])
        verdict = verify_sampling(
            draft_tokens,
            draft_probs,
            target_probs,
            fly=fly,
            target_logits=verified_logits,
            generator=generator,
            draft_confidence=draft.confidence,
        )
        return verdict, target_logits


def _generator(
    device: torch.device, config: DecodeConfig, *, offset: int = 0
) -> torch.Generator | None:
    """A private random generator on ``device`` for a sampled request (None when greedy).

    Seeded from ``config.sampling.seed`` (plus ``offset``, so that the draft's and the target's
    streams differ) or else from fresh entropy; torch's global generator is never touched.
    """
    if config.sampling.greedy and config.draft_temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if config.sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(config.sampling.seed + offset)
    return generator


def _language_model(model: torch.nn.Module | LanguageModel, forward_path: str) -> LanguageModel:
    """A torch module wrapped with its KV cache; a language model as it is."""
    if isinstance(model, torch.nn.Module):
        return CachedLM(model, forward_path=forward_path)
    return model


def _resize_vocab(probs: torch.Tensor, size: int) -> torch.Tensor:
    """Pad with zeros or cut ``[K, V_draft] -> [K, size]`` (models padded to other sizes)."""
    if probs.shape[-1] == size:
        return probs
    if probs.shape[-1] > size:
        return probs[..., :size]
    return torch.nn.functional.pad(probs, (0, size - probs.shape[-1]))
