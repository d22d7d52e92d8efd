"""The decoding loop: draft -> one target forward -> verify -> commit -> repeat.

Caches are never cropped by hand here: :class:`~flyspec.models.cache.CachedLM` is always
given the committed sequence and drops whatever it cached beyond the common prefix, which is
exactly the rejected part of the last block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Sequence

import torch

from flyspec.config import DecodeConfig, SamplingConfig
from flyspec.decoding.auto_k.measure import measure_costs
from flyspec.decoding.auto_k.policy import AutoKPolicies, RequestAutoK, largest_block
from flyspec.decoding.auto_k.store import CostStore
from flyspec.decoding.drafters import Draft, Drafter, make_drafter
from flyspec.decoding.drafters.base import through_end
from flyspec.decoding.grammar import Grammar, RequestGrammar
from flyspec.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from flyspec.decoding.penalties import RequestPenalties
from flyspec.decoding.request import BusyClock, Origin, Request, TokenEvent
from flyspec.decoding.stats import RequestStats
from flyspec.decoding.verify import (
    Verdict,
    greedy_tokens,
    sampling_logits,
    verify_greedy,
    verify_sampling,
)
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM, DeviceTokens, LanguageModel, read_later
from flyspec.models.prompt_cache import PromptCache

__all__ = [
    "DECODER_REVISION",
    "Origin",
    "SpeculativeDecoder",
    "TokenEvent",
    "budget_margin",
    "text_settings",
]

PROMPT_LOGPROB_ROWS = 256
"""Positions whose logits one forward of :meth:`SpeculativeDecoder.prompt_logprobs` reads
(a whole long prompt's would be gigabytes: 151,936 floats a position)."""

DECODER_REVISION = 4
"""The revision of what the decoder emits. Bump it with every change that can alter the
tokens emitted for some :class:`DecodeConfig` (verification, drafting, where blocks are cut
near the budget or an end-of-sequence token): caches of generated text key on it, so no
cached text outlives the code that produced it."""

_SPECULATION_SETTINGS = ("drafter", "k", "fly", "draft_temperature", "draft_confidence", "auto_k")
_DRAFTING_SETTINGS = ("max_ngram", "mla_proposals")
_PENALTY_SETTINGS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


def text_settings(config: DecodeConfig) -> dict:
    """The settings of ``config`` that the emitted tokens depend on, as plain data: all of
    them but the token budget (see :func:`budget_margin`), less those the mode ignores (the
    target alone drafts nothing; exact speculative decoding has no FLy rule)."""
    settings = dataclasses.asdict(config)
    settings.pop("max_new_tokens")
    for name, value in dataclasses.asdict(SamplingConfig()).items():
        if name in _PENALTY_SETTINGS and settings["sampling"][name] == value:
            settings["sampling"].pop(name)  # off: the keys of texts decoded before them
    if not config.auto_k:
        settings.pop("auto_k")
    if config.fly_in_force is None or not config.loosen_predicted:
        settings.pop("loosen_predicted")
    if config.fly_in_force is None or not config.first_token_alone:
        settings.pop("first_token_alone")
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
    ``auto`` (the default: compiled on CUDA, lean elsewhere, where the architecture allows),
    ``lean``, ``compiled`` or ``transformers`` (:func:`flyspec.models.cache.make_forward`).
    ``reuse_prefix``: the models keep their caches from one request to the next, so that a
    request reads only what its prompt does not share with what they hold (a second request
    about the same file pays no second prefill, as llama-server's prompt cache), and of many
    earlier requests with :meth:`keep_prompts`; off by default, as a request's tokens may then
    depend on the one before through rounding (the shared prefix's keys and values were
    computed in other forwards).
    """

    def __init__(
        self,
        target: torch.nn.Module | LanguageModel,
        draft: torch.nn.Module | LanguageModel | None = None,
        *,
        eos_token_ids: Collection[int] = (),
        forward_path: str = "auto",
        reuse_prefix: bool = False,
    ) -> None:
        self.reuse_prefix = reuse_prefix
        self.target = _language_model(target, forward_path)
        self.draft = _language_model(draft, forward_path) if draft is not None else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.auto_k = AutoKPolicies()  # what -k auto learns, across requests
        self.auto_k_store: CostStore | None = None  # where its costs are kept between processes
        self.vocab_size = self.target.vocab_size
        self._end_token_tensors: dict[torch.device, torch.Tensor] = {}
        self.prompt_cache: PromptCache | None = None

    def keep_prompts(self, budget_bytes: int) -> None:
        """Keep the models' states of recent requests in host memory, up to ``budget_bytes``
        in all (0: none), restored by longest common prefix when a request's prompt shares
        more with one than with the live caches (:mod:`flyspec.models.prompt_cache`). With
        ``reuse_prefix`` only: without it every request starts afresh."""
        self.prompt_cache = PromptCache(budget_bytes) if budget_bytes else None
        for lm, name in ((self.target, "target"), (self.draft, "draft")):
            if lm is not None:
                lm.use_prompt_cache(self.prompt_cache, name=name)

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        stats: RequestStats | None = None,
        drafter: Drafter | None = None,
        prediction: Sequence[int] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> Iterator[TokenEvent]:
        """Yield committed tokens until ``max_new_tokens`` or EOS; never more.

        ``stats`` (optional) is filled in as the request runs. The caller may stop iterating at
        any time (a stop string, a disconnect); nothing past that point is computed.
        ``drafter``: any :class:`~flyspec.decoding.drafters.Drafter` instead of the built-in one
        ``config.drafter`` names (not in mode ``target``, which drafts nothing).
        ``prediction``: token ids the answer is expected to largely repeat (Predicted
        Outputs): blocks come from it where the answer follows it, else from the built-in
        drafter (:class:`~flyspec.decoding.drafters.prediction.PredictionDrafter`); mode ``target``
        drafts nothing and ignores it.
        ``logprobs``: each event carries its token's log-probability under the distribution
        verification read (:mod:`flyspec.decoding.logprobs`), with that many of the likeliest
        tokens there (0 to 20; None: none are computed, the default: one read more a round).
        ``grammar``: the answer follows it (:mod:`flyspec.decoding.grammar`): the target's
        and the draft model's distributions are masked by it and blocks are cut where they
        break it; the request ends (an end token) only where the grammar is complete.
        """
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise FlyspecError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        request = self._start(prompt_ids, config, stats, drafter, prediction, logprobs, grammar)
        generator = _generator(self.target.device, config)
        try:
            alone = request.drafter is None and request.grammar is None
            if alone and config.sampling.greedy and logprobs is None:
                yield from self._run_ahead(request)
                return
            while (room := request.room()) > 0:
                k = request.block_size(room)
                request.catch_up(k)
                draft = request.draft(k)
                if draft.unread and not config.sampling.greedy:
                    draft = self._read(draft)
                target_logits = self._score(request.context, draft)  # one forward: [k + 1, V]
                target_logits = request.constrain(target_logits, draft)
                verdict = self._verify(draft, target_logits, config, generator)
                if draft.unread:  # read with the verdict: settled without another read
                    self.target.record_steps(verdict.draft_ids)
                    draft = draft.settled(verdict.draft_ids, verdict.num_drafted)
                committed = request.commit(draft, verdict, target_logits)
                request.learn(draft, verdict)
                yield from request.deliver(committed)
                if committed.finished:
                    request.stats.finish_reason = "stop"
                    return
            request.stats.finish_reason = "length"
        finally:
            request.clock.resume()
            request.stats.seconds = request.clock.elapsed()
            if self.reuse_prefix:  # each model keeps its state where it has a prompt cache
                for lm in (self.target, self.draft):
                    if lm is not None:
                        lm.keep()

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], *, top: int = 0
    ) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability under the target's distribution after the
        tokens before it (its raw logits: no penalties, temperature 1), with the ``top``
        likeliest tokens there; None for the first token, which follows nothing. What
        evaluation harnesses read of a text (OpenAI's ``echo`` with ``logprobs``): forwards
        over the prompt, :data:`PROMPT_LOGPROB_ROWS` positions at a time."""
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise FlyspecError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if len(prompt_ids) == 0:
            raise FlyspecError("the prompt is empty: give at least one token")
        if not self.reuse_prefix:
            self.target.reset()
        self.target.follow(None)
        records: list[TokenLogprob | None] = [None]
        for start in range(0, len(prompt_ids) - 1, PROMPT_LOGPROB_ROWS):
            end = min(start + PROMPT_LOGPROB_ROWS, len(prompt_ids) - 1)
            logits = self.target.logits(prompt_ids[:end], end - start)  # rows predict start+1..
            following = torch.tensor(prompt_ids[start + 1 : end + 1], device=logits.device)
            records += token_logprobs(logits, following, top=top)
        return records

    def _run_ahead(self, request: Request) -> Iterator[TokenEvent]:
        """The target alone, greedy, running ahead of the host as gpt-fast's decoding does:
        each token, chosen on the device, is the input of the next forward, launched before
        the host reads the token. The host checks it (an end token, the budget; the caller a
        stop string) one step late: a request that ends there has computed one forward too
        many, and emitted nothing past its end. The same forwards, and so the same tokens,
        as the rounds of the target alone in :meth:`stream`; one read of the device a token."""
        penalties = request.penalties
        logits = self.target.logits(request.context, 1)
        if penalties is not None:
            logits = penalties.apply(logits)
        token = greedy_tokens(logits[-1])  # on the device, unread
        while (room := request.room()) > 0:
            request.draft(0)  # no block: times the round from here
            chosen, read = token, read_later(token)
            logits = None
            if room > 1:  # the next forward, launched before the host waits for this token
                logits = self.target.step(chosen)
                if penalties is not None:  # the context and the token not yet committed
                    logits = penalties.apply(logits[None], after=chosen.reshape(1))[0]
                token = greedy_tokens(logits)
            value = read()
            if logits is not None:
                self.target.record_steps([value])
            verdict = Verdict(
                num_drafted=0,
                num_kept=0,
                loose_positions=(),
                next_token=value,
                device_tokens=(chosen.new_empty(0), chosen.reshape(1)),
            )
            committed = request.commit(Draft.empty(), verdict, target_logits=None)
            yield from request.deliver(committed)
            if committed.finished:
                request.stats.finish_reason = "stop"
                return
        request.stats.finish_reason = "length"

    def _start(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        stats: RequestStats | None,
        drafter: Drafter | None,
        prediction: Sequence[int] | None,
        logprobs: int | None,
        grammar: Grammar | None,
    ) -> Request:
        """Check the request, make its drafter, prefill the prompt (all but its last token:
        each round feeds the last committed token together with the draft block) and, with
        ``-k auto``, measure what it chooses from."""
        if len(prompt_ids) == 0:
            raise FlyspecError("the prompt is empty: give at least one token")
        if drafter is not None and config.mode == "target":
            raise FlyspecError("mode 'target' drafts nothing: give a drafter with spd or fly")
        if drafter is not None and prediction is not None:
            raise FlyspecError("give a drafter or a prediction, not both")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise FlyspecError(
                f"{type(drafter).__name__} is not a drafter: subclass "
                "flyspec.decoding.drafters.Drafter, or define propose, reset, plan and observe"
            )
        stats = stats if stats is not None else RequestStats()
        stats.prompt_tokens = len(prompt_ids)
        clock = BusyClock()
        # The caches sized for the whole request at once: none of its forwards reallocates.
        largest = 0 if config.mode == "target" else largest_block(config, "prediction")
        positions = len(prompt_ids) + config.max_new_tokens + largest + 1
        # The context on the device too, which the forwards and blocks are taken from.
        tokens = DeviceTokens(prompt_ids, device=self.target.device, capacity=positions)
        penalties = None
        if config.sampling.penalised:
            penalties = RequestPenalties(
                config.sampling,
                tokens=tokens,
                prompt_length=len(prompt_ids),
                vocab_size=self.vocab_size,
            )
        matcher = None
        if grammar is not None:
            matcher = RequestGrammar(grammar, tokens=tokens, prompt_length=len(prompt_ids))
        # The built-in drafter's draft model, where it drafts: -k auto reads its cost.
        draft_lm = self.draft if drafter is None and config.uses_draft_model else None
        given = drafter is not None
        if drafter is None:
            drafter = self._make_drafter(config, tokens, prediction, penalties, matcher)
        if not self.reuse_prefix:
            self.target.reset()
        for lm in (self.target, self.draft if config.uses_draft_model else None):
            if lm is not None:
                lm.reserve(positions)
                lm.follow(tokens)
        # A built-in drafter is new and holds nothing but the draft model's cache.
        if drafter is not None and (given or not self.reuse_prefix):
            drafter.reset()
        context = tokens.ids
        if len(context) > 1:
            stats.cached_prompt_tokens = self.target.prefill(context[:-1])
            # With -k auto the draft model reads the prompt when it first needs to: to time
            # itself (the decoder's first request) or before its first block.
            if draft_lm is not None and not config.auto_k and prediction is None:
                draft_lm.prefill(context[:-1])
        stats.prefill_seconds = clock.elapsed()
        auto = None
        if config.auto_k and drafter is not None:
            measure_costs(
                self.auto_k,
                self.target,
                context,
                config,
                draft_lm=draft_lm,
                store=self.auto_k_store,
            )
            auto = RequestAutoK(self.auto_k, config)
        return Request(
            tokens=tokens,
            penalties=penalties,
            grammar=matcher,
            logprobs=logprobs,
            config=config,
            stats=stats,
            drafter=drafter,
            draft_lm=draft_lm,
            auto=auto,
            eos_token_ids=self.eos_token_ids,
            clock=clock,
        )

    def _make_drafter(
        self,
        config: DecodeConfig,
        tokens: DeviceTokens,
        prediction: Sequence[int] | None,
        penalties: RequestPenalties | None,
        grammar: RequestGrammar | None,
    ) -> Drafter | None:
        """The built-in drafter ``config`` names (None for the target alone) for a request
        whose context, the prompt so far, is ``tokens``, drafting from ``prediction`` first
        where one is given, its model under the request's ``penalties`` and ``grammar``."""
        generator = None
        if self.draft is not None and config.draft_temperature > 0:
            generator = _generator(self.draft.device, config, offset=1)
        return make_drafter(
            config,
            draft_lm=self.draft,
            end_tokens=self.eos_token_ids,
            generator=generator,
            prediction=prediction,
            prompt_length=len(tokens),
            context=tokens,
            penalties=penalties,
            grammar=grammar,
        )

    def _end_tokens(self, device: torch.device) -> torch.Tensor:
        """The end tokens ``long[E]`` on ``device`` (made once)."""
        if device not in self._end_token_tensors:
            ids = sorted(self.eos_token_ids)
            self._end_token_tensors[device] = torch.tensor(ids, dtype=torch.long, device=device)
        return self._end_token_tensors[device]

    def _score(self, context: list[int], draft: Draft) -> torch.Tensor:
        """The target's one forward over the last committed token and ``draft``: ``[K+1, V]``
        (the block goes to the target as it is, on the device; unread, or with its ids)."""
        ids = None if draft.unread else draft.token_ids
        return self.target.logits_with_block(context, draft.tokens, ids=ids)

    def _read(self, draft: Draft) -> Draft:
        """An unread draft read on its own (verification at temperature > 0 reads it apart),
        cut after an end token."""
        ids = draft.tokens.tolist()
        return draft.settled(ids, len(through_end(ids, self.eos_token_ids)))

    def _verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        config: DecodeConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        """The verdict on ``draft`` from the target's ``[K+1, V]`` logits over it. Tokens
        drafted from a prediction are verified exactly unless ``config.loosen_predicted``. An
        unread draft is read with the verdict and cut after an end token there."""
        draft_tokens = draft.tokens.to(target_logits.device)
        fly = config.fly_in_force
        if draft.source == "prediction" and not config.loosen_predicted:
            fly = None
        if config.sampling.greedy:
            return verify_greedy(
                draft_tokens,
                target_logits,
                fly=fly,
                draft_confidence=draft.confidence,
                end_tokens=self._end_tokens(target_logits.device) if draft.unread else None,
            )
        verified_logits = sampling_logits(target_logits, config.sampling)
        target_probs = verified_logits.softmax(dim=-1)
        draft_probs = draft.probs
        if draft_probs is not None:
            draft_probs = _resize_vocab(draft_probs.to(target_probs.device), target_probs.shape[-1])
        return verify_sampling(
            draft_tokens,
            draft_probs,
            target_probs,
            fly=fly,
            target_logits=verified_logits,
            generator=generator,
            draft_confidence=draft.confidence,
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
