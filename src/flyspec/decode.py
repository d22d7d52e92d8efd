"""The decoding loop: draft -> one target forward -> verify -> commit -> repeat.

Caches are never cropped by hand here: :class:`~flyspec.models.cache.CachedLM` is always
given the committed sequence and drops whatever it cached beyond the common prefix, which is
exactly the rejected part of the last block.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from flyspec.config import DecodeConfig
from flyspec.drafters import Draft, Drafter, MlaDrafter, ModelDrafter, NgramDrafter
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM
from flyspec.stats import RequestStats, RoundStats
from flyspec.verify import Verdict, sampling_probs, verify_greedy, verify_sampling

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


class _BusyClock:
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


class SpeculativeDecoder:
    """Runs requests on one target model and an optional draft model (batch size 1).

    ``eos_token_ids``: tokens that end a request; they are not emitted. ``forward_path``:
    ``lean`` (the default, where the architecture allows) or ``transformers``
    (:func:`flyspec.models.cache.make_forward`).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None = None,
        *,
        eos_token_ids: Collection[int] = (),
        forward_path: str = "lean",
    ) -> None:
        self.target = CachedLM(target, forward_path=forward_path)
        self.draft = CachedLM(draft, forward_path=forward_path) if draft is not None else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = _output_vocab_size(target)

    def _drafter(self, config: DecodeConfig, generator: torch.Generator | None) -> Drafter | None:
        if config.mode == "target":
            return None
        if config.drafter == "ngram":
            return NgramDrafter(max_ngram=config.max_ngram, end_tokens=self.eos_token_ids)
        if self.draft is None:
            raise FlyspecError(
                f"mode {config.mode!r} with the {config.drafter!r} drafter needs a draft model"
            )
        if config.drafter == "mla":
            return MlaDrafter(
                self.draft,
                proposals=config.mla_proposals,
                max_ngram=config.max_ngram,
                min_confidence=config.draft_confidence,
                end_tokens=self.eos_token_ids,
            )
        return ModelDrafter(
            self.draft,
            temperature=config.draft_temperature,
            generator=generator,
            min_confidence=config.draft_confidence,
            end_tokens=self.eos_token_ids,
        )

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        stats: RequestStats | None = None,
    ) -> Iterator[TokenEvent]:
        """Yield committed tokens until ``max_new_tokens`` or EOS; never more.

        ``stats`` (optional) is filled in as the request runs. The caller may stop iterating at
        any time (a stop string, a disconnect); nothing past that point is computed.
        """
        if len(prompt_ids) == 0:
            raise FlyspecError("the prompt is empty: give at least one token")
        stats = stats if stats is not None else RequestStats()
        stats.prompt_tokens = len(prompt_ids)
        target_generator = _generator(self.target.device, config)
        draft_generator = None
        if self.draft is not None and config.draft_temperature > 0:
            draft_generator = _generator(self.draft.device, config, offset=1)
        drafter = self._drafter(config, draft_generator)
        clock = _BusyClock()

        self.target.reset()
        if drafter is not None:
            drafter.reset()
        context = list(prompt_ids)
        # Prefill everything but the last prompt token: each round feeds the last committed
        # token together with the draft block.
        if len(context) > 1:
            self.target.logits(context[:-1])
            if config.uses_draft_model:
                self.draft.logits(context[:-1])
        stats.prefill_seconds = clock.elapsed()

        produced = 0
        round_index = 0
        try:
            while produced < config.max_new_tokens:
                remaining = config.max_new_tokens - produced
                k = 0 if drafter is None else min(config.k, remaining - 1)
                round_start = time.perf_counter()
                draft = drafter.propose(context, k) if k > 0 else Draft.empty()
                draft_done = time.perf_counter()
                verdict = self._verify(context, draft, config, target_generator)
                verify_done = time.perf_counter()

                tokens = draft.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
                origins = [
                    "loose" if i in verdict.loose_positions else "exact"
                    for i in range(verdict.num_accepted)
                ] + ["bonus" if verdict.is_bonus else "correction"]
                emitted = 0
                finished = False
                for token in tokens:
                    if token in self.eos_token_ids:
                        finished = True
                        break
                    context.append(token)
                    emitted += 1
                round_stats = RoundStats(
                    drafted=len(draft),
                    accepted=verdict.num_accepted - verdict.num_loose,
                    loosely_accepted=verdict.num_loose,
                    emitted=emitted,
                    ended_by_eos=finished,
                    draft_seconds=draft_done - round_start,
                    verify_seconds=verify_done - draft_done,
                )
                stats.add_round(round_stats)
                produced += emitted
                for delivered, (token, origin) in enumerate(
                    zip(tokens[:emitted], origins[:emitted], strict=True), start=1
                ):
                    clock.pause()
                    try:
                        yield TokenEvent(token=token, origin=origin, round_index=round_index)
                    except GeneratorExit:
                        # The caller stopped inside this round: count what it received.
                        stats.rounds[-1] = replace(round_stats, emitted=delivered)
                        stats.finish_reason = "cancelled"
                        raise
                    clock.resume()
                if finished:
                    stats.finish_reason = "stop"
                    return
                round_index += 1
            stats.finish_reason = "length"
        finally:
            clock.resume()
            stats.seconds = clock.elapsed()

    def _verify(
        self,
        context: list[int],
        draft: Draft,
        config: DecodeConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        target_logits = self.target.logits(context + draft.tokens.tolist(), len(draft) + 1)
        draft_tokens = draft.tokens.to(target_logits.device)
        if config.sampling.greedy:
            return verify_greedy(draft_tokens, target_logits, fly=config.loosening)
        target_probs = sampling_probs(target_logits, config.sampling)
        draft_probs = draft.probs
        if draft_probs is not None:
            draft_probs = _resize_vocab(draft_probs.to(target_probs.device), target_probs.shape[-1])
        return verify_sampling(
            draft_tokens,
            draft_probs,
            target_probs,
            fly=config.loosening,
            target_logits=target_logits,
            generator=generator,
        )


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


def _output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the output layer; ``out_features`` also covers packed and quantised layers."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def _resize_vocab(probs: torch.Tensor, size: int) -> torch.Tensor:
    """Pad with zeros or cut ``[K, V_draft] -> [K, size]`` (models padded to other sizes)."""
    if probs.shape[-1] == size:
        return probs
    if probs.shape[-1] > size:
        return probs[..., :size]
    return torch.nn.functional.pad(probs, (0, size - probs.shape[-1]))
