"""Drafting with a small causal LM, one token per forward."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from flyspec.config import SamplingConfig
from flyspec.decoding.drafters.base import Draft, first_unconfident, token_confidence
from flyspec.decoding.verify import sampling_probs
from flyspec.models.cache import LanguageModel


class ModelDrafter:
    """The draft model decodes ``k`` tokens: greedily, or sampled at ``temperature > 0`` (then
    the block carries the distributions it was sampled from, for lossless verification).
    The block ends after an ``end_tokens`` token (EOS), and with ``min_confidence > 0`` after
    the first token the model was unsure of."""

    def __init__(
        self,
        lm: LanguageModel,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        min_confidence: float = 0.0,
        end_tokens: Collection[int] = (),
    ) -> None:
        self.lm = lm
        self.end_tokens = frozenset(end_tokens)
        self.sampling = SamplingConfig(temperature=temperature)
        self.generator = generator
        self.min_confidence = min_confidence

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens after ``context``, one forward each. Each token is read back once
        (the next forward's input and the end-of-sequence check need it); the confidences are
        read once per block, unless ``min_confidence`` needs each one at once."""
        sequence = list(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        confidence: list[torch.Tensor] = []  # float[1] each, where read at once
        chosen: list[torch.Tensor] = []  # long[1] each, on the model's device, else
        rows: list[torch.Tensor] = []  # [V] each: the logits each token was chosen from
        for _ in range(k):
            logits = self.lm.logits(sequence, 1)[0]  # [V]
            if self.sampling.greedy:
                choice = logits.argmax().reshape(1)
            else:
                step_probs = sampling_probs(logits, self.sampling)
                choice = torch.multinomial(step_probs, 1, generator=self.generator)
                probs.append(step_probs)
            token = int(choice)
            tokens.append(token)
            sequence.append(token)
            if self.min_confidence > 0:
                confidence.append(token_confidence(logits[None], choice).cpu())
            else:
                chosen.append(choice)
                rows.append(logits)
            if token in self.end_tokens:
                break
            if confidence and first_unconfident(confidence[-1], self.min_confidence) is not None:
                break
        if rows:
            confidence = [token_confidence(torch.stack(rows), torch.cat(chosen)).cpu()]
        return Draft(
            tokens=torch.tensor(tokens, dtype=torch.long),
            probs=torch.stack(probs) if probs else None,
            confidence=torch.cat(confidence) if confidence else None,
        )

    def reset(self) -> None:
        self.lm.reset()
