"""The methods a benchmark compares, each behind one small interface.

A method runs one prompt to the end and returns the new token ids and the wall time of the
call. flyspec's own methods (``target``, ``spd``, ``ngram``, ``fly``, ``fly-mla``) also return
their per-round statistics; transformers' peers (``hf-*``: ``model.generate`` with an assistant
model or prompt lookup) return tokens and time only. llama.cpp's own decoding of the GGUF files
(``llamacpp-target``, and ``llamacpp-lookup``, the binding's prompt-lookup speculative decoding)
return tokens and time; flyspec's loop on llama.cpp forwards (``llamacpp-flyspec-target``,
the target alone as ``flyspec serve --backend llamacpp --mode target`` decodes, ``llamacpp-spd``,
``llamacpp-ngram``, ``llamacpp-fly``, ``llamacpp-fly-mla``) is flyspec's decoder on the
llama.cpp engine. llama.cpp's own server (``llama-server``, ``llama-server-ngram-mod``,
``llama-server-ngram-simple``, ``llama-server-draft``: :mod:`flyspec.bench.llama_server`) runs
as a child process on the same GGUF files. Every method stops at the same EOS set and
``max_new_tokens`` and counts only newly generated tokens.

A speculative method's name may end in ``@K`` to set its block size apart from ``-k``:
``fly@5``, ``llamacpp-fly@8``, or ``fly@auto`` (the block chosen every round,
:mod:`flyspec.decoding.auto_k`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Protocol

from flyspec.bench.llama_server import (
    LLAMA_SERVER_METHODS,
    LLAMA_SERVER_SIZED,
    LlamaServerMethod,
    ServerSetup,
)
from flyspec.bench.sample_run import SampleRun
from flyspec.config import DecodeConfig, FlyConfig
from flyspec.decoding.stats import RequestStats
from flyspec.errors import FlyspecError

# name -> (mode, drafter) of flyspec's decoder.
FLYSPEC_METHODS: dict[str, tuple[str, str]] = {
    "target": ("target", "model"),
    "spd": ("spd", "model"),
    "ngram": ("spd", "ngram"),
    "fly": ("fly", "model"),
    "fly-mla": ("fly", "mla"),
    "fly-paper": ("fly", "model"),
    "predict": ("spd", "ngram"),
    "fly-predict": ("fly", "ngram"),
    "predict-draft": ("spd", "model"),
}
PREDICTION_METHODS = frozenset({"predict", "fly-predict", "predict-draft"})
"""Drafting from the prompt's prediction (Predicted Outputs), then prompt lookup: exact
(``predict``) or FLy (``fly-predict``; the predicted tokens themselves verified exactly unless
``--loosen-predicted``); then also the draft model, where neither has a block (new text:
``predict-draft``, exact, what a server request with a prediction and the default drafter
does)."""
PAPER_RULE_METHODS = frozenset({"fly-paper"})
"""FLy at the paper's default rule (theta 0.3, W 6, top-3 entropy, no rule beyond the paper),
whatever the FLy flags say: the reference that settings of ``fly`` are compared with in one
run."""
HF_METHODS = ("hf-assisted-k", "hf-assisted", "hf-pld", "hf-target")
# name -> flyspec's method it runs on the llama.cpp engine.
LLAMACPP_LOOP_METHODS: dict[str, str] = {
    "llamacpp-flyspec-target": "target",
    "llamacpp-spd": "spd",
    "llamacpp-ngram": "ngram",
    "llamacpp-fly": "fly",
    "llamacpp-fly-mla": "fly-mla",
    "llamacpp-predict": "predict",
    "llamacpp-fly-predict": "fly-predict",
    "llamacpp-predict-draft": "predict-draft",
}
LLAMACPP_OWN_METHODS = ("llamacpp-target", "llamacpp-lookup")
LLAMACPP_METHODS = (*LLAMACPP_OWN_METHODS, *LLAMACPP_LOOP_METHODS)
LLAMA_SERVER_METHOD_NAMES = tuple(LLAMA_SERVER_METHODS)  # flyspec.bench.llama_server
GGUF_METHODS = (*LLAMA_SERVER_METHOD_NAMES, *LLAMACPP_METHODS)  # on the pair's GGUF files
PEER_BASELINES = {"llama-server": "llama_server", "llamacpp-target": "llamacpp"}
"""llama.cpp's plain decoding, by its server and by its binding -> the suffix of the report's
keys of speedups over it (``speedup_over_llama_server``, ``decode_speedup_over_llamacpp``):
where one runs, every method's speedup over it is reported beside the baseline's."""
DEFAULT_METHODS = (
    "target",
    "spd",
    "ngram",
    "fly",
    "fly-mla",
    "hf-assisted-k",
    "hf-assisted",
    "hf-pld",
)
VLLM_METHOD_NAMES = ("vllm-target", "vllm-spd", "vllm-fly")  # flyspec.bench.vllm
DEFAULT_VLLM_METHODS = (*VLLM_METHOD_NAMES, "target", "fly", "fly-mla")
IN_PROCESS_METHODS = (*FLYSPEC_METHODS, *HF_METHODS)  # run on a loaded flyspec Engine
ALL_METHODS = (*IN_PROCESS_METHODS, *GGUF_METHODS, *VLLM_METHOD_NAMES)
METHODS_NEEDING_DRAFT = frozenset(
    {"spd", "fly", "fly-mla", "fly-paper", "predict-draft", "hf-assisted-k", "hf-assisted"}
)
LLAMACPP_METHODS_NEEDING_DRAFT = frozenset(
    name for name, method in LLAMACPP_LOOP_METHODS.items() if method in METHODS_NEEDING_DRAFT
) | {name for name, spec_type in LLAMA_SERVER_METHODS.items() if spec_type == "draft-simple"}
LOSSLESS_METHODS = frozenset(
    {
        "target",
        "spd",
        "ngram",
        "hf-target",
        "vllm-target",
        "vllm-spd",
        "llamacpp-target",
        "llamacpp-lookup",
        "llamacpp-flyspec-target",
        "llamacpp-spd",
        "llamacpp-ngram",
        "predict",
        "predict-draft",
        "llamacpp-predict",
        "llamacpp-predict-draft",
        *LLAMA_SERVER_METHOD_NAMES,
    }
)
SPECULATIVE_METHODS = frozenset(
    {name for name, (mode, _) in FLYSPEC_METHODS.items() if mode != "target"}
    | {name for name, method in LLAMACPP_LOOP_METHODS.items() if method != "target"}
    | LLAMA_SERVER_SIZED
)


def method_base(name: str) -> str:
    """A method's name without its ``@K`` block size: ``fly@5`` -> ``fly``."""
    return name.partition("@")[0]


def method_block(name: str) -> int | str | None:
    """The block size a method's name sets: ``fly@5`` -> 5, ``fly@auto`` -> ``"auto"``,
    ``fly`` -> None (``-k``'s). FlyspecError for a bad one."""
    base, at, text = name.partition("@")
    if not at:
        return None
    if base not in SPECULATIVE_METHODS:
        raise FlyspecError(f"method {base} drafts nothing: it takes no @K (in {name!r})")
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise FlyspecError(f"the block size after @ must be an integer >= 1 or auto, in {name!r}")
    return int(text)


def flyspec_method(name: str) -> str:
    """The flyspec method a method of flyspec's decoder runs, on either engine, without its
    ``@K``: ``llamacpp-fly@5`` -> ``fly``. FlyspecError for a method that is not one."""
    base = method_base(name)
    method = LLAMACPP_LOOP_METHODS.get(base, base)
    if method not in FLYSPEC_METHODS:
        raise FlyspecError(f"{name} is not a method of flyspec's decoder")
    return method


def method_config(name: str, config: DecodeConfig) -> DecodeConfig:
    """The settings flyspec's decoder runs method ``name`` with (``fly``, ``fly@5``,
    ``llamacpp-fly-mla``...): ``config`` in the method's mode and drafter, with its block
    size, and the paper's rule for ``fly-paper``."""
    mode, drafter = FLYSPEC_METHODS[flyspec_method(name)]
    if method_base(name) in PAPER_RULE_METHODS:
        config = config.with_updates(fly=FlyConfig())
    block = method_block(name)
    if block == "auto":
        config = config.with_updates(auto_k=True)
    elif block is not None:
        config = config.with_updates(k=block, auto_k=False)
    return config.with_updates(mode=mode, drafter=drafter)


def uses_prediction(name: str) -> bool:
    """Whether method ``name`` drafts from the prompt's prediction (Predicted Outputs)."""
    base = method_base(name)
    return LLAMACPP_LOOP_METHODS.get(base, base) in PREDICTION_METHODS


def parse_methods(text: str, *, baseline: str = "target") -> list[str]:
    """``"target,fly"`` -> ``["target", "fly"]``, validated; the ``baseline`` of every
    speedup comes first (added when missing)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise FlyspecError(f"--methods is empty; choose from {', '.join(ALL_METHODS)}")
    unknown = [name for name in names if method_base(name) not in ALL_METHODS]
    if unknown:
        raise FlyspecError(
            f"unknown method(s) {', '.join(unknown)} in --methods; "
            f"choose from {', '.join(ALL_METHODS)} (a speculative one may end in @K or @auto)"
        )
    for name in names:
        method_block(name)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise FlyspecError(f"method(s) listed twice in --methods: {', '.join(duplicates)}")
    rest = [name for name in names if name != baseline]
    # llama-server's rows first: what the others are set beside.
    rest.sort(key=lambda name: method_base(name) not in LLAMA_SERVER_METHOD_NAMES)
    return [baseline, *rest]


def measured_run(method, prompt_ids: Sequence[int], **settings) -> SampleRun:
    """``method.run(prompt_ids, **settings)`` with the peak resident memory of this process
    and its children (a vLLM engine's) while it ran, and the resident memory the run touched:
    the method's own (its models, caches and buffers), apart from the other methods' models
    loaded in the same process (:func:`flyspec.support.resident_memory.touched_bytes`)."""
    from flyspec.support.resident_memory import PeakRss, forget_touched, touched_bytes

    forget_touched()
    with PeakRss() as watch:
        run = method.run(prompt_ids, **settings)
    return replace(run, peak_rss_bytes=watch.peak_bytes, touched_bytes=touched_bytes())


class BenchMethod(Protocol):
    name: str
    settings: dict

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        """Generate for one prompt; ``seed`` seeds sampling (ignored when greedy);
        ``prediction_ids``: the prompt's prediction (Predicted Outputs), which the methods
        that draft from one use and the others ignore."""
        ...


def _cut_at_eos(tokens: Sequence[int], eos_token_ids: frozenset[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos_token_ids:
            return list(tokens[:index])
    return list(tokens)


class FlyspecMethod:
    """flyspec's decoder in one mode/drafter, on whichever backend ``engine`` runs; timed around
    the whole token stream."""

    def __init__(self, name: str, engine, config: DecodeConfig) -> None:
        self.name = name
        self.decoder = engine.decoder
        self.config = config = method_config(name, config)
        mode, drafter = config.mode, config.drafter
        self.uses_prediction = uses_prediction(name)
        self.settings = {"mode": mode, "drafter": drafter, "backend": engine.backend}
        if self.uses_prediction:
            self.settings.update(prediction=True, loosen_predicted=config.loosen_predicted)
        if mode != "target":
            self.settings["k"] = "auto" if config.auto_k else config.k
        if mode == "fly":
            self.settings.update(asdict(config.fly))

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        config = self.config.with_updates(
            max_new_tokens=max_new_tokens, sampling=replace(self.config.sampling, seed=seed)
        )
        stats = RequestStats()
        prediction = prediction_ids if self.uses_prediction and prediction_ids else None
        started = time.perf_counter()
        events = self.decoder.stream(prompt_ids, config, stats=stats, prediction=prediction)
        tokens = [event.token for event in events]
        seconds = time.perf_counter() - started
        models = [self.decoder.target, self.decoder.draft]
        state = sum(model.state_bytes() for model in models if model is not None)
        return SampleRun(
            tokens, seconds, stats, state_bytes=state, prefill_seconds=stats.prefill_seconds
        )


class HfMethod:
    """transformers' ``generate`` on the target: assisted by the draft model (``hf-assisted-k``
    with a constant ``K`` draft tokens and no confidence stop; ``hf-assisted`` with the
    assistant's defaults), by prompt lookup (``hf-pld``), or alone (``hf-target``)."""

    def __init__(self, name: str, engine, config: DecodeConfig) -> None:
        if name not in HF_METHODS:
            raise FlyspecError(f"not a transformers method: {name!r}")
        self.name = name
        self.target = engine.target_model
        self.draft = engine.draft_model
        self.eos_token_ids = frozenset(engine.decoder.eos_token_ids)
        pad = engine.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)
        self.sampling = config.sampling
        self.k = config.k
        self.assistant_config = None
        self.kwargs: dict = {}
        if name in ("hf-assisted-k", "hf-assisted"):
            if self.draft is None:
                raise FlyspecError(f"method {name} needs a draft model")
            # transformers reads these from the *assistant's* generation config.
            self.assistant_config = copy.deepcopy(self.draft.generation_config)
            if name == "hf-assisted-k":
                self.assistant_config.num_assistant_tokens = config.k
                self.assistant_config.num_assistant_tokens_schedule = "constant"
                self.assistant_config.assistant_confidence_threshold = 0.0
        elif name == "hf-pld":
            self.kwargs["prompt_lookup_num_tokens"] = config.k
        self.settings = self._describe()

    def _describe(self) -> dict:
        if self.assistant_config is None:
            return dict(self.kwargs)
        defaults = self.assistant_config._get_default_generation_params()
        return {
            key: getattr(self.assistant_config, key, None)
            if getattr(self.assistant_config, key, None) is not None
            else defaults.get(key)
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            )
        }

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        import torch

        device = next(self.target.parameters()).device
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        kwargs = dict(self.kwargs)
        if self.assistant_config is not None:
            kwargs["assistant_model"] = self.draft
        sampling = self.sampling
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=sampling.temperature,
                top_k=sampling.top_k or None,
                top_p=sampling.top_p,
            )
            torch.manual_seed(seed if seed is not None else torch.seed())
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        # transformers warns about its own internal calls of assisted generation.
        hf_logging.set_verbosity_error()
        saved = None
        if self.assistant_config is not None:
            saved = self.draft.generation_config
            self.draft.generation_config = copy.deepcopy(self.assistant_config)
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                output = self.target.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=sorted(self.eos_token_ids),
                    pad_token_id=self.pad_token_id,
                    **kwargs,
                )
            seconds = time.perf_counter() - started
        finally:
            if saved is not None:
                self.draft.generation_config = saved
            hf_logging.set_verbosity(verbosity)
        new_tokens = output[0, input_ids.shape[1] :].tolist()
        return SampleRun(_cut_at_eos(new_tokens, self.eos_token_ids), seconds)


class LlamaCppOwnMethod:
    """llama.cpp's own decoding through its binding's ``Llama.generate`` on the target's GGUF
    file: greedy or sampled plain decoding (``llamacpp-target``), or the binding's prompt-lookup
    speculative decoding with ``K`` proposed tokens (``llamacpp-lookup``). The state is reset
    before every prompt, so no method reuses another prompt's cache.

    The lookup keeps logits for every position of its context (1.2 GB at 2048 positions of
    the default target), so its context is sized to what the longest prompt needs: ``longest``
    positions and a block of K + 1; a generation that would still run out of it stops with a
    FlyspecError instead of overrunning the binding's buffers."""

    def __init__(
        self,
        name: str,
        *,
        gguf: str | Path,
        threads: int,
        context: int,
        eos_token_ids: Collection[int],
        config: DecodeConfig,
        longest: int | None = None,
    ) -> None:
        from flyspec.models.llamacpp import default_threads
        from flyspec.models.llamacpp_binding import ensure_llamacpp_decodes, require_llamacpp

        llama_cpp = require_llamacpp()
        ensure_llamacpp_decodes()
        draft_model = None
        self.block = 1
        if name == "llamacpp-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft_model = LlamaPromptLookupDecoding(
                max_ngram_size=config.max_ngram, num_pred_tokens=config.k
            )
            self.block = config.k + 1
            needed = (longest or min(context, 2048)) + self.block
            if needed > context:
                raise FlyspecError(
                    f"{name} needs a context of {needed} positions (the longest prompt, its "
                    f"new tokens and a block of {self.block}); llama.cpp's is {context}: "
                    "raise --llamacpp-context"
                )
            context = needed
        threads = threads or default_threads()
        self.name = name
        self.weights = Path(gguf).name
        self.llama = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft_model,
            # The binding decodes with every position's logits once it has a draft model but
            # sizes its buffer for them by this flag alone: without it, a prompt longer than
            # one batch overruns the buffer.
            logits_all=draft_model is not None,
            verbose=False,
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampling = config.sampling
        self.settings = {"backend": "llamacpp", "binding": "Llama.generate", "threads": threads}
        if draft_model is not None:
            self.settings.update(k=config.k, max_ngram=config.max_ngram)

    def run(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int | None,
        prediction_ids: Sequence[int] | None = None,
    ) -> SampleRun:
        if len(prompt_ids) + max_new_tokens > self.llama.n_ctx():
            raise FlyspecError(
                f"{self.name}: a prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new "
                f"ones exceeds its context of {self.llama.n_ctx()}"
            )
        sampling = self.sampling
        if not sampling.greedy:
            self.llama.set_seed(seed if seed is not None else 0)
        tokens: list[int] = []
        self.llama.reset()
        started = time.perf_counter()
        # The prompt but its last token first, timed apart, as flyspec's loop reads it: the
        # binding's generate then reuses it and reads the last token with the first step.
        if len(prompt_ids) > 1:
            self.llama.eval(list(prompt_ids[:-1]))
        prefill_seconds = time.perf_counter() - started
        for token in self.llama.generate(
            list(prompt_ids),
            temp=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=0.0,
            repeat_penalty=1.0,
        ):
            if token in self.eos_token_ids:
                break
            tokens.append(int(token))
            if len(tokens) == max_new_tokens:
                break
            if self.llama.n_tokens + self.block > self.llama.n_ctx():
                raise FlyspecError(
                    f"{self.name} ran out of its context of {self.llama.n_ctx()} positions "
                    f"after {len(tokens)} new tokens (the binding holds {self.llama.n_tokens})"
                )
        seconds = time.perf_counter() - started
        return SampleRun(tokens, seconds, prefill_seconds=prefill_seconds)


def make_method(
    name: str,
    engine,
    config: DecodeConfig,
    *,
    llamacpp_engine=None,
    longest: int | None = None,
) -> BenchMethod:
    """The method ``name`` on ``engine`` (flyspec's and transformers'), or on
    ``llamacpp_engine`` (the ``llamacpp-*`` methods: the same pair's GGUF files). ``longest``:
    the most positions a prompt and its new tokens take (what a context must hold)."""
    base = method_base(name)
    if base in GGUF_METHODS and llamacpp_engine is None:
        raise FlyspecError(f"method {name} runs on the GGUF files: it needs a llama.cpp engine")
    if base in LLAMA_SERVER_METHOD_NAMES:
        block = method_block(name)
        if block == "auto":
            raise FlyspecError(f"{name}: llama-server has no auto block size; give @K")
        return LlamaServerMethod(
            name,
            ServerSetup.of_engine(llamacpp_engine),
            k=block or config.k,
            eos_token_ids=llamacpp_engine.decoder.eos_token_ids,
            sampling=config.sampling,
        ).start()
    if base in LLAMACPP_METHODS:
        if base in LLAMACPP_OWN_METHODS:
            lm = llamacpp_engine.decoder.target
            return LlamaCppOwnMethod(
                name,
                gguf=lm.path,
                threads=lm.threads,
                context=lm.context_length,
                eos_token_ids=llamacpp_engine.decoder.eos_token_ids,
                config=config,
                longest=longest,
            )
        return FlyspecMethod(name, llamacpp_engine, config)
    if base in FLYSPEC_METHODS:
        return FlyspecMethod(name, engine, config)
    if name in HF_METHODS:
        return HfMethod(name, engine, config)
    if name in VLLM_METHOD_NAMES:
        raise FlyspecError(f"method {name} runs in vLLM: add --engine vllm")
    raise FlyspecError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}")
