"""Penalties and biases on the target's distribution (OpenAI's ``presence_penalty``,
``frequency_penalty`` and ``logit_bias``; ``repetition_penalty`` as vLLM and transformers
define it): pure tensor functions, no models, no caches.

A penalty depends on the tokens before the position it scores. Row ``i`` of a block's
``[K+1, V]`` logits scores the token after draft token ``i - 1``, so it sees the answer so far
and the draft tokens ``0..i-1``: the rows of a block are penalised as the target alone would
penalise them, token after token, had it emitted the draft tokens before them. Verification
then reads the penalised logits, exact, sampled or loosened alike: the emitted tokens follow
the penalised distribution, and exact decoding stays lossless with respect to it.

Notation as in :mod:`flyspec.decoding.verify`: ``K`` draft tokens, ``V`` the vocabulary size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from flyspec.config import SamplingConfig
from flyspec.models.cache import DeviceTokens


def row_counts(answer_counts: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """How often each token occurs before each row of a block: ``float[V], long[K] ->
    float[K+1, V]``. Row ``i`` counts the answer so far and draft tokens ``0..i-1``."""
    vocab_size = answer_counts.shape[0]
    drafted = torch.zeros(
        draft_tokens.shape[0] + 1,
        vocab_size,
        dtype=answer_counts.dtype,
        device=answer_counts.device,
    )
    if draft_tokens.shape[0]:
        # A draft token outside the target's vocabulary (a larger draft head) counts nowhere.
        inside = (draft_tokens < vocab_size).to(drafted.dtype)[:, None]
        drafted[1:].scatter_(1, draft_tokens.clamp(0, vocab_size - 1)[:, None], inside)
    return answer_counts + drafted.cumsum(dim=0)


def bias_vector(
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...],
    vocab_size: int,
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``logit_bias`` (token id -> bias) as ``float[V]``, 0 where none is given; ids past the
    vocabulary are left out (a padded head can be smaller than the tokenizer). A bias of -100
    bans its token, as OpenAI describes it: -inf, which no rule keeps, FLy's loosened
    acceptance included (it never keeps a token the target cannot emit)."""
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    for token, value in dict(logit_bias).items():
        if 0 <= token < vocab_size:
            bias[token] = -math.inf if value <= -100 else value
    return bias.to(device)


def penalised_logits(
    logits: torch.Tensor,
    counts: torch.Tensor,
    *,
    sampling: SamplingConfig,
    in_prompt: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits with ``sampling``'s penalties and ``bias`` applied: ``[R, V], float[R, V] ->
    float[R, V]``, where ``counts`` says how often each token occurred in the answer before
    each row (:func:`row_counts`).

    In this order: the repetition penalty (a token of the prompt, ``in_prompt`` ``bool[V]``, or
    of the answer so far has a positive logit divided by it and a negative one multiplied),
    then ``frequency_penalty`` times the count and ``presence_penalty`` once for a token that
    occurred, subtracted (OpenAI's definition, over the answer only), then ``bias`` ``float[V]``
    added. Without any, the logits as they are.
    """
    if not sampling.penalised and bias is None:
        return logits
    penalised = logits.float()
    vocab_size = penalised.shape[-1]
    counts = _fit(counts, vocab_size)
    occurred = counts > 0
    if sampling.repetition_penalty != 1.0:
        seen = occurred if in_prompt is None else occurred | _fit(in_prompt, vocab_size)
        penalty = sampling.repetition_penalty
        factor = torch.where(penalised > 0, 1 / penalty, penalty)
        penalised = torch.where(seen, penalised * factor, penalised)
    if sampling.frequency_penalty:
        penalised = penalised - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        penalised = penalised - sampling.presence_penalty * occurred.to(penalised.dtype)
    if bias is not None:
        penalised = penalised + _fit(bias, vocab_size)
    return penalised


def _fit(values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``values`` ``[..., V']`` cut or padded with zeros to ``[..., vocab_size]`` (a draft
    model's head may be padded to another size than the target's)."""
    if values.shape[-1] >= vocab_size:
        return values[..., :vocab_size]
    fitted = values.new_zeros((*values.shape[:-1], vocab_size))
    fitted[..., : values.shape[-1]] = values
    return fitted


class RequestPenalties:
    """A request's penalties on the device: what :func:`penalised_logits` reads, kept for the
    request's context ``tokens`` (its answer starts after ``prompt_length`` tokens). The
    answer's counts are counted again from the device's context when it has changed (one
    kernel a round, no read), so that rolled-back tokens leave them as well."""

    def __init__(
        self,
        sampling: SamplingConfig,
        *,
        tokens: DeviceTokens,
        prompt_length: int,
        vocab_size: int,
    ) -> None:
        self.sampling = sampling
        self.tokens = tokens
        self.prompt_length = prompt_length
        self.vocab_size = vocab_size
        device = tokens.device
        self.bias = None
        if sampling.logit_bias:
            self.bias = bias_vector(sampling.logit_bias, vocab_size, device=device)
        self.in_prompt = None
        if sampling.repetition_penalty != 1.0:
            prompt = tokens.span(0, prompt_length)
            self.in_prompt = self._count(prompt) > 0
        self._counted: tuple[int, torch.Tensor] | None = None

    def apply(
        self,
        logits: torch.Tensor,
        *,
        after: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``logits`` ``[R, V]`` penalised for the positions after the context, then
        ``after`` ``long[m]`` (tokens drafted since), then each of ``block`` ``long[R-1]``
        before its row (:func:`row_counts`)."""
        counts = self._answer_counts()
        if after is not None and after.shape[0]:
            counts = counts + self._count(after.to(counts.device))
        if block is None:
            block = counts.new_zeros(logits.shape[0] - 1, dtype=torch.long)
        counts = row_counts(counts, block.to(counts.device))
        penalised = penalised_logits(
            logits,
            counts.to(logits.device),
            sampling=self.sampling,
            in_prompt=self._on(logits),
            bias=None if self.bias is None else self.bias.to(logits.device),
        )
        return penalised

    def _on(self, logits: torch.Tensor) -> torch.Tensor | None:
        return None if self.in_prompt is None else self.in_prompt.to(logits.device)

    def _count(self, tokens: torch.Tensor) -> torch.Tensor:
        """``float[V]``: how often each token occurs in ``tokens`` ``long[n]``."""
        counts = torch.bincount(tokens, minlength=self.vocab_size)[: self.vocab_size]
        return counts.float()

    def _answer_counts(self) -> torch.Tensor:
        """``float[V]``: the answer's counts, counted again where the context has changed."""
        version = self.tokens.version
        if self._counted is None or self._counted[0] != version:
            answer = self.tokens.span(self.prompt_length, len(self.tokens))
            self._counted = (version, self._count(answer))
        return self._counted[1]
