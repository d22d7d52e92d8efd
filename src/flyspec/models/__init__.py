"""Model loading, the embedded default pair, and (in `cache`) KV-cache helpers."""

from flyspec.models.default_pair import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DefaultModel,
    DefaultPair,
    default_pair_paths,
    is_default_pair_installed,
    pull_default_pair,
    resolve_pair,
)
from flyspec.models.loading import (
    check_same_tokenizer,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
)
from flyspec.support.home import flyspec_home

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "DefaultModel",
    "DefaultPair",
    "check_same_tokenizer",
    "default_pair_paths",
    "flyspec_home",
    "is_default_pair_installed",
    "load_causal_lm",
    "load_tokenizer",
    "pull_default_pair",
    "resolve_pair",
    "resolve_device",
]
