"""Drafters: the draft model, prompt-lookup n-grams, MLA (both combined) and a prediction of
the answer (Predicted Outputs, backed by one of the others); any object that follows
:class:`Drafter` can stand in for them."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.drafters.base import Draft, Drafter
from flyspec.decoding.drafters.mla import MlaDrafter
from flyspec.decoding.drafters.model import ModelDrafter
from flyspec.decoding.drafters.ngram import NgramDrafter, find_ngram_continuation
from flyspec.decoding.drafters.prediction import PredictionDrafter
from flyspec.decoding.penalties import RequestPenalties
from flyspec.errors import FlyspecError
from flyspec.models.cache import DeviceTokens, LanguageModel

if TYPE_CHECKING:
    from flyspec.decoding.grammar import RequestGrammar

__all__ = [
    "Draft",
    "Drafter",
    "MlaDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "PredictionDrafter",
    "find_ngram_continuation",
    "make_drafter",
]


def make_drafter(
    config: DecodeConfig,
    *,
    draft_lm: LanguageModel | None,
    end_tokens: Collection[int] = (),
    generator: torch.Generator | None = None,
    prediction: Sequence[int] | None = None,
    prompt_length: int = 0,
    context: DeviceTokens | None = None,
    penalties: RequestPenalties | None = None,
    grammar: RequestGrammar | None = None,
) -> Drafter | None:
    """The built-in drafter ``config.drafter`` names, with ``config``'s settings (None in mode
    ``target``). ``draft_lm``: the draft model, which ``model`` and ``mla`` need;
    ``generator``: the random source of a sampled draft. With a ``prediction`` (token ids of
    the expected answer, after ``prompt_length`` prompt tokens), blocks come from it first,
    then from prompt lookup, then from the draft model where ``config.drafter`` uses one.
    ``context``: the request's context on the device, which blocks from the context or the
    prediction are cut from (none: they are copied from the host). ``penalties`` and
    ``grammar``: the request's, which the draft model drafts under as the target is verified
    under them."""
    if config.mode == "target":
        return None
    if prediction is not None:
        fallback = None
        if config.drafter != "ngram":
            fallback = make_drafter(
                config,
                draft_lm=draft_lm,
                end_tokens=end_tokens,
                generator=generator,
                penalties=penalties,
                grammar=grammar,
            )
        return PredictionDrafter(
            prediction,
            prompt_length=prompt_length,
            fallback=fallback,
            max_ngram=config.max_ngram,
            end_tokens=end_tokens,
            context=context,
        )
    if config.drafter == "ngram":
        return NgramDrafter(max_ngram=config.max_ngram, end_tokens=end_tokens, context=context)
    if draft_lm is None:
        raise FlyspecError(
            f"mode {config.mode!r} with the {config.drafter!r} drafter needs a draft model"
        )
    if config.drafter == "mla":
        return MlaDrafter(
            draft_lm,
            proposals=config.mla_proposals,
            max_ngram=config.max_ngram,
            min_confidence=config.draft_confidence,
            end_tokens=end_tokens,
            penalties=penalties,
            grammar=grammar,
        )
    return ModelDrafter(
        draft_lm,
        temperature=config.draft_temperature,
        generator=generator,
        min_confidence=config.draft_confidence,
        end_tokens=end_tokens,
        penalties=penalties,
        grammar=grammar,
    )
