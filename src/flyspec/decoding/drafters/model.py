"""Drafting with a small causal LM, one token per forward."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from flyspec.config import SamplingConfig
from flyspec.decoding.drafters.base import (
    Draft,
    Drafter,
    first_unconfident,
    through_end,
    token_confidence,
)
from flyspec.decoding.penalties import RequestPenalties
from flyspec.decoding.verify import greedy_tokens, sampling_probs
from flyspec.models.cache import LanguageModel

if TYPE_CHECKING:
    from flyspec.decoding.grammar import RequestGrammar


class ModelDrafter(Drafter):
    """The draft model decodes ``k`` tokens: greedily, or sampled at ``temperature > 0`` (then
    the block carries the distributions it was sampled from, for lossless verification).
    The block ends after an ``end_tokens`` token (EOS), and with ``min_confidence > 0`` after
    the first token the model was unsure of. With a request's ``penalties``, each step
    chooses from its logits penalised as the target's are, the block's earlier tokens
    counted; with its ``grammar``, from the tokens the grammar allows after them (each token
    is then read as it is chosen, which the next step's mask depends on)."""

    def __init__(
        self,
        lm: LanguageModel,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        min_confidence: float = 0.0,
        end_tokens: Collection[int] = (),
        penalties: RequestPenalties | None = None,
        grammar: RequestGrammar | None = None,
    ) -> None:
        self.lm = lm
        self.penalties = penalties
        self.grammar = grammar
        self.end_tokens = frozenset(end_tokens)
        self.sampling = SamplingConfig(temperature=temperature)
        self.generator = generator
        self.min_confidence = min_confidence

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens after ``context``, one forward each. The chosen tokens stay on
        the model's device, each the input of the next forward: drafting costs no host
        synchronisation per token. A greedy block is left unread (``Draft.unread``), for the
        decoder to read with its verdict; a sampled one is read once here and cut after an
        end token (the steps past it were spent for nothing, once a request). Only with
        ``min_confidence > 0`` is each token read at once, to end the block early."""
        if k <= 0:
            return Draft.empty()
        logits = self.lm.logits(context, 1)[0]  # [V]
        chosen: list[torch.Tensor] = []  # long[1] each, on the model's device
        probs: list[torch.Tensor] = []  # [V] each, where sampled
        rows: list[torch.Tensor] = []  # [V] each: the logits each token was chosen from
        read: list[int] = []  # the chosen tokens' ids, read one by one under a grammar
        for index in range(k):
            if index:
                logits = self.lm.step(chosen[-1])
            if self.penalties is not None:
                drafted = torch.cat(chosen) if chosen else None
                logits = self.penalties.apply(logits[None], after=drafted)[0]
            if self.grammar is not None:
                logits = self.grammar.apply(logits[None], after=read)[0]
            choice, step_probs = self._choose(logits)
            chosen.append(choice)
            rows.append(logits)
            if step_probs is not None:
                probs.append(step_probs)
            if self.grammar is not None:
                read.append(int(choice))
                if read[-1] in self.end_tokens:
                    break
            if self.min_confidence > 0 and self._ends_block(logits, choice):
                break
        chosen_tokens = torch.cat(chosen)  # long[n]
        confidence = token_confidence(torch.stack(rows), chosen_tokens)  # float[n]
        if self.sampling.greedy and self.min_confidence <= 0 and self.grammar is None:
            # Unread: the decoder reads it with its verdict, cut after an end token there.
            return Draft(
                tokens=chosen_tokens,
                confidence=confidence,
                unread=True,
                settle=lambda ids: self.lm.record_steps(ids[:-1]),
            )
        read = chosen_tokens.tolist()  # the block's one read
        self.lm.record_steps(read[:-1])  # the steps fed all but the last
        tokens = through_end(read, self.end_tokens)
        return Draft(
            tokens=chosen_tokens[: len(tokens)],
            probs=torch.stack(probs[: len(tokens)]) if probs else None,
            confidence=confidence[: len(tokens)],
            ids=tuple(tokens),
        )

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token ``long[1]`` from ``logits`` ``[V]``: the argmax, or a sample with
        the distribution it was drawn from ``[V]``."""
        if self.sampling.greedy:
            return greedy_tokens(logits).reshape(1), None
        step_probs = sampling_probs(logits, self.sampling)
        return torch.multinomial(step_probs, 1, generator=self.generator), step_probs

    def _ends_block(self, logits: torch.Tensor, choice: torch.Tensor) -> bool:
        """Whether the block ends after ``choice``: an end token, or one the model was unsure
        of (reads both from the device)."""
        if int(choice) in self.end_tokens:
            return True
        confidence = token_confidence(logits[None], choice)
        return first_unconfident(confidence, self.min_confidence) is not None

    def reset(self) -> None:
        self.lm.reset()
