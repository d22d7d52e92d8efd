"""Multi-level acceleration (MLA): the draft model, sped up by n-gram proposals.

Each draft-model forward scores up to ``proposals`` n-gram tokens at once; the draft keeps the
leading ones that equal its own greedy choice plus one token of its own. The block is therefore
the draft model's plain greedy block; MLA changes how many forwards it costs, not what it says.
Where no n-gram matches, the step is an ordinary one-token draft step. The block ends after
an end token, and with a confidence threshold where the plain drafter's would.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from flyspec.config import DEFAULT_MAX_NGRAM, DEFAULT_MLA_PROPOSALS
from flyspec.decoding.drafters.base import (
    Draft,
    Drafter,
    end_index,
    first_unconfident,
    token_confidence,
)
from flyspec.decoding.drafters.ngram import find_ngram_continuation
from flyspec.decoding.penalties import RequestPenalties
from flyspec.decoding.verify import greedy_tokens
from flyspec.models.cache import LanguageModel

if TYPE_CHECKING:
    from flyspec.decoding.grammar import RequestGrammar


class MlaDrafter(Drafter):
    """Greedy model drafting that verifies prompt-lookup proposals in its own forwards (under
    the request's ``penalties`` and ``grammar`` where given, as the model drafter; a proposal
    is cut before the first token the grammar forbids)."""

    def __init__(
        self,
        lm: LanguageModel,
        *,
        proposals: int = DEFAULT_MLA_PROPOSALS,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        min_confidence: float = 0.0,
        end_tokens: Collection[int] = (),
        penalties: RequestPenalties | None = None,
        grammar: RequestGrammar | None = None,
    ) -> None:
        self.lm = lm
        self.penalties = penalties
        self.grammar = grammar
        self.end_tokens = frozenset(end_tokens)
        self.proposals = proposals
        self.max_ngram = max_ngram
        self.min_confidence = min_confidence

    def propose(self, context: Sequence[int], k: int) -> Draft:
        sequence = list(context)
        tokens: list[int] = []
        confidence: list[torch.Tensor] = []
        while len(tokens) < k:
            # Room for the proposal plus the draft model's own token.
            room = min(self.proposals, k - len(tokens) - 1)
            proposal = find_ngram_continuation(sequence, k=room, max_ngram=self.max_ngram)
            if self.grammar is not None:
                proposal = proposal[: self.grammar.allowed_prefix(proposal, after=tokens)]
            logits = self.lm.logits(sequence + proposal, len(proposal) + 1)  # [P+1, V]
            if self.penalties is not None:  # the block so far, and the proposal before each row
                logits = self.penalties.apply(
                    logits,
                    after=torch.tensor(tokens, dtype=torch.long),
                    block=torch.tensor(proposal, dtype=torch.long),
                )
            if self.grammar is not None:
                logits = self.grammar.apply(logits, after=tokens, block=proposal)
            greedy = greedy_tokens(logits)
            matches = 0
            while matches < len(proposal) and proposal[matches] == int(greedy[matches]):
                matches += 1
            step = proposal[:matches] + [int(greedy[matches])]
            step_confidence = token_confidence(logits[: len(step)], greedy[: len(step)]).cpu()
            unsure_at = first_unconfident(step_confidence, self.min_confidence)
            ends_at = end_index(step, self.end_tokens)
            cut = min((i for i in (unsure_at, ends_at) if i is not None), default=None)
            if cut is not None:
                tokens.extend(step[: cut + 1])
                confidence.append(step_confidence[: cut + 1])
                break
            tokens.extend(step)
            confidence.append(step_confidence)
            sequence.extend(step)
        return Draft(
            tokens=torch.tensor(tokens[:k], dtype=torch.long),
            confidence=torch.cat(confidence)[:k] if confidence else None,
            ids=tuple(tokens[:k]),
        )

    def reset(self) -> None:
        self.lm.reset()
