"""Frozen, validated configuration: the one home of every default.

Mapping to the paper and the authors' released code:

* ``k`` is the draft block length (the paper's K, default 15).
* ``window`` is W, the number of draft tokens *after* a mismatch that must all match the
  target exactly for the mismatch to be kept loosely (default 6, as in the paper). The authors'
  code counts a pattern of ``win_len`` positions that includes the mismatch itself, so their
  ``win_len = 6`` is our ``window = 5``; our ``window = 6`` is their ``win_len = 7``.
* ``theta`` is the entropy threshold of the gate (default 0.3); ``entropy="top3"`` is the
  authors' top-3 entropy in nats, ``entropy="normalized"`` the paper's full-vocabulary entropy
  divided by log |V|.

Beyond the paper (all off by default, so the default rule is the paper's):

* ``min_ratio`` and ``max_rank`` form a *plausibility floor*: a mismatch is loosened only where
  the target's probability of the draft token is at least ``min_ratio`` times that of its own
  top token, and the draft token is among its ``max_rank`` most likely tokens.
* ``max_draft_confidence`` asks the draft model to be unsure too: a mismatch is loosened only
  where the draft model gave its own token at most this probability (softmax of its raw
  logits), on the idea that where both models hesitate the two tokens are often two ways of
  saying the same thing (docs/rules.md measures how far that holds). A drafter that gives no
  probabilities (prompt lookup) counts as sure.
* ``defer`` carries a mismatch whose window does not fit in its block into the next block:
  its tokens are held back until the window completes there, or rolled back to the target's
  correction when it fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from flyspec.errors import FlyspecError

Mode = Literal["target", "spd", "fly"]
DrafterName = Literal["model", "ngram", "mla"]
EntropyKind = Literal["top3", "normalized"]

MODES: tuple[str, ...] = ("target", "spd", "fly")
DRAFTERS: tuple[str, ...] = ("model", "ngram", "mla")
ENTROPY_KINDS: tuple[str, ...] = ("top3", "normalized")

DEFAULT_K = 15
DEFAULT_WINDOW = 6
DEFAULT_THETA = 0.3
DEFAULT_MAX_NGRAM = 4
DEFAULT_MLA_PROPOSALS = 6
DEFAULT_MAX_NEW_TOKENS = 128
MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: logits divided by them overflow float32 (vLLM treats
temperatures below the same value as greedy)."""
MAX_SEED = 2**63 - 1
LONG_BLOCK = 64
"""The longest block of a prediction's unbroken run (``-k auto``'s kind ``prediction``),
whatever ``-k``: such a block costs nothing to draft and is mostly kept, so on a forward whose
cost hardly grows with its length (a GPU) a long one pays. The compiled forward's largest size
is one more: the block and the token before it."""

LINEAR_KERNELS: tuple[str, ...] = ("onednn", "default")
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "fp16")
FORWARD_PATHS: tuple[str, ...] = ("auto", "lean", "transformers", "compiled")
"""``auto``: ``compiled`` for a model on CUDA, ``lean`` elsewhere (where the lean forward cannot
run a model, both give transformers' forward)."""


class ConfigError(FlyspecError, ValueError):
    """A configuration value is out of range or unknown; ``field`` names the setting."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _check(condition: bool, message: str, *, field: str) -> None:
    if not condition:
        raise ConfigError(message, field=field)


@dataclass(frozen=True)
class FlyConfig:
    """The loosening rule: entropy gate plus deferred window (docs/design.md), with the
    optional plausibility floor (``min_ratio``, ``max_rank``), the draft's doubt
    (``max_draft_confidence``; 1 = off) and deferral across blocks (``defer``)."""

    window: int = DEFAULT_WINDOW
    theta: float = DEFAULT_THETA
    entropy: EntropyKind = "top3"
    min_ratio: float = 0.0
    max_rank: int = 0
    max_draft_confidence: float = 1.0
    defer: bool = False

    def __post_init__(self) -> None:
        _check(
            isinstance(self.window, int) and self.window >= 0,
            f"window must be an integer >= 0, got {self.window!r}",
            field="window",
        )
        _check(
            isinstance(self.theta, (int, float)) and not math.isnan(self.theta) and self.theta >= 0,
            f"theta must be a number >= 0 (inf switches loosening off), got {self.theta!r}",
            field="theta",
        )
        _check(
            self.entropy in ENTROPY_KINDS,
            f"entropy must be one of {', '.join(ENTROPY_KINDS)}, got {self.entropy!r}",
            field="entropy",
        )
        _check(
            isinstance(self.min_ratio, (int, float))
            and not isinstance(self.min_ratio, bool)
            and 0 <= self.min_ratio <= 1,
            f"min_ratio must be a number in [0, 1] (0 = off), got {self.min_ratio!r}",
            field="min_ratio",
        )
        _check(
            isinstance(self.max_rank, int)
            and not isinstance(self.max_rank, bool)
            and self.max_rank >= 0,
            f"max_rank must be an integer >= 0 (0 = off), got {self.max_rank!r}",
            field="max_rank",
        )
        _check(
            isinstance(self.max_draft_confidence, (int, float))
            and not isinstance(self.max_draft_confidence, bool)
            and 0 <= self.max_draft_confidence <= 1,
            "max_draft_confidence must be a number in [0, 1] (1 = off), "
            f"got {self.max_draft_confidence!r}",
            field="max_draft_confidence",
        )
        _check(
            isinstance(self.defer, bool),
            f"defer must be true or false, got {self.defer!r}",
            field="defer",
        )

    @property
    def beyond_paper(self) -> bool:
        """Whether any rule beyond the paper's gate and window is on."""
        return (
            self.min_ratio > 0 or self.max_rank > 0 or self.max_draft_confidence < 1 or self.defer
        )


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels run the models once loaded (:mod:`flyspec.models.kernels`); the defaults are
    those of every command and every published figure.

    ``linear``: float32 Linear layers on oneDNN with pre-packed weights, or torch's default.
    ``draft_quant`` / ``target_quant``: int8 (dynamic) or fp16 weights for that model's Linear
    layers; a quantised draft never changes what exact SPD emits, a quantised target does.
    ``forward``: flyspec's lean forward with a preallocated KV cache (Llama-family models;
    others fall back), the same through ``torch.compile`` (CUDA graphs on a GPU;
    :class:`~flyspec.models.lean.LeanForward`), transformers' ``model(...)``, or ``auto``
    (compiled on CUDA, lean elsewhere). Only ``forward`` applies off the CPU.
    """

    linear: str = "onednn"
    draft_quant: str = "int8"
    target_quant: str = "none"
    forward: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in (
            ("linear", LINEAR_KERNELS),
            ("draft_quant", QUANTIZATIONS),
            ("target_quant", QUANTIZATIONS),
            ("forward", FORWARD_PATHS),
        ):
            value = getattr(self, name)
            _check(
                value in choices,
                f"{name} must be one of {', '.join(choices)}, got {value!r}",
                field=name,
            )

    @classmethod
    def plain(cls) -> KernelConfig:
        """torch's and transformers' own kernels: the models exactly as loaded."""
        return cls(
            linear="default", draft_quant="none", target_quant="none", forward="transformers"
        )


BACKENDS = ("torch", "llamacpp")
"""What runs the models' forwards: torch (any Hugging Face causal LM, any device), or llama.cpp
(GGUF files on the CPU, through llama-cpp-python)."""


@dataclass(frozen=True)
class LlamaCppConfig:
    """Settings of the llama.cpp backend: the context it allocates (prompt + generated tokens)
    and its threads (0: the cores this process may run on)."""

    context: int = 8192
    threads: int = 0

    def __post_init__(self) -> None:
        _check(
            isinstance(self.context, int) and self.context >= 16,
            f"the llama.cpp context must be an integer >= 16, got {self.context!r}",
            field="context",
        )
        _check(
            isinstance(self.threads, int) and self.threads >= 0,
            f"llama.cpp threads must be an integer >= 0 (0 = every core), got {self.threads!r}",
            field="threads",
        )


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's tokens are chosen; temperature 0 (or below :data:`MIN_TEMPERATURE`)
    means greedy. Penalties and biases change the target's distribution before it is chosen
    from (:mod:`flyspec.decoding.penalties`): ``presence_penalty`` and ``frequency_penalty``
    as OpenAI defines them (in [-2, 2], over the tokens generated), ``repetition_penalty`` as
    vLLM and transformers do (> 0, 1 = off, over the prompt and the tokens generated),
    ``logit_bias`` as ``(token id, bias)`` pairs (each bias in [-100, 100])."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2 <= value <= 2,
                f"{name} must be a number in [-2, 2], got {value!r}",
                field=name,
            )
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
            f"repetition_penalty must be a number in (0, 100] (1 = off), "
            f"got {self.repetition_penalty!r}",
            field="repetition_penalty",
        )
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        _check(
            isinstance(bias, tuple)
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], int)
                and not isinstance(pair[0], bool)
                and pair[0] >= 0
                and _is_number(pair[1])
                and -100 <= pair[1] <= 100
                for pair in bias
            ),
            "logit_bias must map token ids (integers >= 0) to biases in [-100, 100], "
            f"got {self.logit_bias!r}",
            field="logit_bias",
        )
        object.__setattr__(self, "logit_bias", tuple(sorted(bias)))
        self._check_choice()

    @property
    def penalised(self) -> bool:
        """Whether a penalty or a bias changes the target's distribution."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def _check_choice(self) -> None:
        _check(
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
            field="temperature",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}",
            field="top_k",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
            field="top_p",
        )
        _check(
            self.seed is None
            or (isinstance(self.seed, int) and not isinstance(self.seed, bool))
            and 0 <= self.seed <= MAX_SEED,
            f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}",
            field="seed",
        )
        object.__setattr__(self, "temperature", _greedy_below_minimum(self.temperature))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _greedy_below_minimum(temperature: float) -> float:
    """``temperature``, or 0.0 (greedy) where it is below :data:`MIN_TEMPERATURE`."""
    return 0.0 if temperature < MIN_TEMPERATURE else temperature


@dataclass(frozen=True)
class DecodeConfig:
    """One request's decoding settings.

    ``mode``: ``target`` (target alone, the baseline), ``spd`` (exact speculative decoding) or
    ``fly`` (exact matches plus loosely accepted mismatches). ``drafter``: ``model`` (the draft
    model), ``ngram`` (prompt lookup) or ``mla`` (draft model sped up by n-gram proposals).
    ``draft_confidence``: the draft model ends its block early, after the first token it gave
    a probability below this value (0, the default, drafts all ``k`` tokens); it saves draft
    forwards that would likely be rejected, like transformers' assistant confidence threshold.
    ``auto_k``: choose the block size every round, from 0 (the target alone) to ``k``, for the
    most expected tokens per second (:mod:`flyspec.decoding.auto_k`).
    ``loosen_predicted``: FLy's rule applies to tokens drafted from a request's prediction
    (Predicted Outputs) too; by default they are verified exactly, so that an edit the target
    makes where it is unsure is not lost to the unedited code the prediction proposes
    (docs/design.md, "Predicted Outputs").
    ``first_token_alone``: the first round is the target's alone, so that the first token
    comes after one forward of the target instead of after a drafted and verified block: a
    streamed request's time to first token (the server's default for streams). The tokens of
    an exact mode are the same; in FLy the first token is the target's own.
    """

    mode: Mode = "fly"
    drafter: DrafterName = "model"
    k: int = DEFAULT_K
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    fly: FlyConfig = field(default_factory=FlyConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    draft_temperature: float = 0.0
    draft_confidence: float = 0.0
    max_ngram: int = DEFAULT_MAX_NGRAM
    mla_proposals: int = DEFAULT_MLA_PROPOSALS
    stop: tuple[str, ...] = ()
    auto_k: bool = False
    loosen_predicted: bool = False
    first_token_alone: bool = False

    def __post_init__(self) -> None:
        _check(
            self.mode in MODES,
            f"mode must be one of {', '.join(MODES)}, got {self.mode!r}",
            field="mode",
        )
        _check(
            self.drafter in DRAFTERS,
            f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}",
            field="drafter",
        )
        _check(
            isinstance(self.k, int) and self.k >= 1,
            f"k must be an integer >= 1, got {self.k!r}",
            field="k",
        )
        _check(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}",
            field="max_new_tokens",
        )
        _check(
            isinstance(self.draft_temperature, (int, float))
            and math.isfinite(self.draft_temperature)
            and self.draft_temperature >= 0,
            f"draft_temperature must be a finite number >= 0, got {self.draft_temperature!r}",
            field="draft_temperature",
        )
        object.__setattr__(self, "draft_temperature", _greedy_below_minimum(self.draft_temperature))
        _check(
            isinstance(self.draft_confidence, (int, float)) and 0 <= self.draft_confidence < 1,
            f"draft_confidence must be in [0, 1) (0 = off), got {self.draft_confidence!r}",
            field="draft_confidence",
        )
        _check(
            isinstance(self.max_ngram, int) and self.max_ngram >= 1,
            f"max_ngram must be an integer >= 1, got {self.max_ngram!r}",
            field="max_ngram",
        )
        _check(
            isinstance(self.mla_proposals, int) and self.mla_proposals >= 1,
            f"mla_proposals must be an integer >= 1, got {self.mla_proposals!r}",
            field="mla_proposals",
        )
        _check(
            not (self.drafter == "mla" and self.draft_temperature > 0),
            "the mla drafter drafts greedily; it cannot be combined with draft_temperature > 0",
            field="drafter",
        )
        _check(
            isinstance(self.auto_k, bool),
            f"auto_k must be True or False, got {self.auto_k!r}",
            field="auto_k",
        )
        _check(
            isinstance(self.loosen_predicted, bool),
            f"loosen_predicted must be True or False, got {self.loosen_predicted!r}",
            field="loosen_predicted",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop strings must be non-empty strings, got {self.stop!r}",
            field="stop",
        )

    @property
    def uses_draft_model(self) -> bool:
        return self.mode != "target" and self.drafter in ("model", "mla")

    @property
    def fly_in_force(self) -> FlyConfig | None:
        """``fly`` where it applies (mode fly, theta finite), else None: lossless decoding."""
        if self.mode != "fly" or math.isinf(self.fly.theta):
            return None
        return self.fly

    def with_updates(self, **changes: object) -> DecodeConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)
