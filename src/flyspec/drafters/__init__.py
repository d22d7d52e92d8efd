"""Drafters: the draft model, prompt-lookup n-grams, and MLA (both combined)."""

from flyspec.drafters.base import Draft, Drafter
from flyspec.drafters.mla import MlaDrafter
from flyspec.drafters.model import ModelDrafter
from flyspec.drafters.ngram import NgramDrafter, find_ngram_continuation

__all__ = [
    "Draft",
    "Drafter",
    "MlaDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "find_ngram_continuation",
]
