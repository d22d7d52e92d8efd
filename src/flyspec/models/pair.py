"""A model pair loaded for decoding, on either backend, by one function: :func:`load_pair`.

It resolves the names (the embedded default pair's folders or GGUF files where one is None),
checks that the two tokenizers agree, builds the language models (torch modules switched to
the CPU kernels of a :class:`~flyspec.config.KernelConfig` and wrapped with their KV cache, or
GGUF files run by llama.cpp) and says what runs them (:attr:`LoadedPair.kernels`).
:class:`flyspec.engine.Engine` takes what it returns (``Engine.from_pair``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flyspec.config import BACKENDS, KernelConfig, LlamaCppConfig
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM, LanguageModel
from flyspec.models.default_pair import DefaultPair, default_gguf_paths, default_pair_paths
from flyspec.models.kernels import apply_cpu_kernels, check_compiled_forward, check_target_quant
from flyspec.models.llamacpp import LlamaCppLM, gguf_tokenizer, llamacpp_identity
from flyspec.models.loading import check_same_tokenizer, load_causal_lm, load_tokenizer


@dataclass(frozen=True)
class LoadedPair:
    """A target, an optional draft sharing its tokenizer, and what runs them."""

    target: LanguageModel
    tokenizer: Any
    target_name: str
    draft: LanguageModel | None = None
    draft_name: str | None = None
    kernels: dict = field(default_factory=dict)
    """What runs the models (:func:`describe_kernels`, plus the CPU kernels applied): part of
    what a generation's tokens and speed depend on, so caches and reports key on it."""
    cost_settings: dict = field(default_factory=dict)
    """What the forwards' speed depends on beyond the models and ``kernels`` (the dtype and
    device, or llama.cpp's build): where ``-k auto``'s measured costs are kept."""


def load_pair(
    *,
    target: str | None = None,
    draft: str | None = None,
    with_draft: bool = True,
    backend: str = "torch",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    kernels: KernelConfig | None = None,
    llamacpp: LlamaCppConfig | None = None,
) -> LoadedPair:
    """Load a pair (the embedded default pair where a name is None) and check that the two
    tokenizers agree, before either model is loaded; ``with_draft=False`` skips the draft
    (target-only decoding).

    ``backend="torch"``: Hugging Face models on ``device`` in ``dtype``, switched to
    ``kernels`` (by default the kernels every ``flyspec`` command uses). ``"llamacpp"``: GGUF
    files run by llama.cpp (the default pair's are those of ``flyspec models pull --gguf``)
    with ``llamacpp``'s settings; ``device``, ``dtype`` and ``kernels`` do not apply."""
    if backend not in BACKENDS:
        raise FlyspecError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "llamacpp":
        opener = _llamacpp_opener(llamacpp or LlamaCppConfig())
    else:
        opener = _torch_opener(device=device, dtype=dtype, kernels=kernels or KernelConfig())
    if target is None or (with_draft and draft is None):  # the default pair, only then
        defaults = opener.defaults()
        target = target or str(defaults.target)
        draft = draft or str(defaults.draft)
    draft = draft if with_draft else None
    tokenizer = opener.tokenizer(target)
    draft_model = None
    if draft is not None:
        check_same_tokenizer(
            opener.tokenizer(draft), tokenizer, draft_name=draft, target_name=target
        )
        draft_model = opener.model(draft, "draft")
    target_lm, draft_lm, applied = opener.ready(opener.model(target, "target"), draft_model)
    return LoadedPair(
        target=target_lm,
        draft=draft_lm,
        tokenizer=tokenizer,
        target_name=target,
        draft_name=draft,
        kernels={**describe_kernels(target=target_lm, draft=draft_lm), **applied},
        cost_settings=opener.cost_settings,
    )


@dataclass(frozen=True)
class _Opener:
    """How one backend opens a pair's parts, for :func:`load_pair`."""

    defaults: Callable[[], DefaultPair]
    """The default pair's files."""
    tokenizer: Callable[[str], Any]
    model: Callable[[str, str], Any]
    """A model by name and role (``target`` or ``draft``)."""
    ready: Callable[[Any, Any], tuple[LanguageModel, LanguageModel | None, dict]]
    """The loaded target and draft (or None) as language models, and the kernels applied."""
    cost_settings: dict


def _torch_opener(*, device: str, dtype: torch.dtype, kernels: KernelConfig) -> _Opener:
    """Hugging Face models: the CPU kernels are applied to the loaded modules before they are
    wrapped with their KV cache (the logits' rows are read from the output layer's
    ``out_features``, which packed and quantised layers keep)."""
    if device == "cpu":  # before minutes of loading
        check_target_quant(kernels.target_quant, dtype)
        check_compiled_forward(kernels)

    def model(name: str, role: str) -> torch.nn.Module:
        # Beside a target spread over the GPUs, the small draft lives on the first one.
        on = "cuda:0" if role == "draft" and device == "balanced" else device
        return load_causal_lm(name, dtype=dtype, device=on)

    def ready(target: torch.nn.Module, draft: torch.nn.Module | None):
        applied = apply_cpu_kernels(target=target, draft=draft, kernels=kernels)
        wrapped = [
            None if m is None else CachedLM(m, forward_path=kernels.forward)
            for m in (target, draft)
        ]
        return wrapped[0], wrapped[1], applied

    return _Opener(
        defaults=default_pair_paths,
        tokenizer=load_tokenizer,
        model=model,
        ready=ready,
        cost_settings={"dtype": str(dtype), "device": str(device)},
    )


def _llamacpp_opener(settings: LlamaCppConfig) -> _Opener:
    """GGUF files in llama.cpp, once the binding is known to decode here (before anything
    slow)."""
    from flyspec.models.llamacpp_binding import binding_build, require_llamacpp

    require_llamacpp()

    def model(name: str, role: str) -> LlamaCppLM:
        return LlamaCppLM(name, context=settings.context, threads=settings.threads)

    return _Opener(
        defaults=default_gguf_paths,
        tokenizer=gguf_tokenizer,
        model=model,
        ready=lambda target, draft: (target, draft, {}),
        cost_settings={"binding": binding_build()},
    )


def describe_kernels(*, target: LanguageModel, draft: LanguageModel | None) -> dict:
    """What runs a pair's models, as reports and caches give it: llama.cpp's build, weights,
    threads and context; or torch's kernels (torch's own unless :func:`load_pair` switched
    them) and forward path. The draft's forward path where there is a draft."""
    if isinstance(target, LlamaCppLM):
        kernels: dict = {"backend": "llamacpp", **llamacpp_identity(target)}
    else:
        kernels = {
            "linear": "default",
            "draft_quant": "none",
            "target_quant": "none",
            "forward": target.forward_path,
        }
    if draft is not None:
        kernels["draft_forward"] = draft.forward_path
    return kernels


def end_token_ids(tokenizer, model: torch.nn.Module | LanguageModel) -> set[int]:
    """Every token that ends a request: the tokenizer's EOS and the model's generation config
    (the torch module's, bare or wrapped; a llama.cpp model: the tokens llama.cpp ends a
    generation at)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if isinstance(model, LlamaCppLM):
        return ids | model.end_of_generation_tokens()
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    generation_config = getattr(module, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return ids
