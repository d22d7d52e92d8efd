"""Causal LMs run by llama.cpp (through its Python binding, ``llama-cpp-python``):
:class:`LlamaCppForward` is a forward runner like torch's, and :class:`LlamaCppLM` puts it behind
the same :class:`~flyspec.models.cache.CachedLM`, which reuses the KV cache up to the longest
common prefix and crops it past that.

The binding's low-level C API is used directly (``llama_decode`` over a batch whose last n
positions ask for logits, ``llama_memory_seq_rm`` for the crop), so that one forward scores a
whole draft block, which the binding's high-level ``Llama`` class does not offer without keeping
logits for every position of the context.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from flyspec.config import LlamaCppConfig
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM
from flyspec.models.llamacpp_binding import (
    ensure_llamacpp_decodes,
    llamacpp_version,
    require_llamacpp,
)

_BATCH = 512  # tokens per llama_decode call (a longer prompt is fed in slices)


def default_threads() -> int:
    """llama.cpp's threads: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class LlamaCppForward:
    """A GGUF model in llama.cpp with its KV cache, behind the forward-runner interface
    (:class:`~flyspec.models.cache.ForwardRunner`).

    :meth:`forward` feeds the new tokens in one ``llama_decode`` (in slices of 512 for a long
    prompt) and brings back logits for the last ``num_logits`` only; :meth:`crop` removes
    positions from the KV cache.

    ``check_binding``: first make sure, in a child process, that the binding can decode on
    this CPU (:mod:`flyspec.models.llamacpp_binding`; once per build and machine), so that a
    binding that would crash stops with a one-line error instead.
    """

    forward_path = "llamacpp"
    model = None  # the weights live in llama.cpp

    def __init__(
        self,
        path: str | Path,
        *,
        context: int = LlamaCppConfig.context,
        threads: int = 0,
        check_binding: bool = True,
    ) -> None:
        llama_cpp = require_llamacpp()
        path = Path(path).expanduser()
        if not path.is_file() or path.suffix.lower() != ".gguf":
            raise FlyspecError(f"the llama.cpp backend runs .gguf files; not one: {path}")
        if context < 16:
            raise FlyspecError(f"the llama.cpp context must be at least 16 tokens, got {context}")
        if check_binding:
            ensure_llamacpp_decodes()
        self.path = path
        self.threads = threads or default_threads()
        self._api = llama_cpp
        llama_cpp.llama_backend_init()
        # What the binding's own Llama(verbose=False) does: llama.cpp's errors only.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise FlyspecError(f"llama.cpp could not load {path}")
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = context
        self.batch_size = min(_BATCH, context)
        context_params.n_batch = self.batch_size
        context_params.n_ubatch = self.batch_size
        context_params.n_seq_max = 1
        context_params.n_threads = self.threads
        context_params.n_threads_batch = self.threads
        context_params.no_perf = True
        self._context = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._context:
            llama_cpp.llama_model_free(self._model)
            raise FlyspecError(f"llama.cpp could not make a context of {context} tokens for {path}")
        self._memory = llama_cpp.llama_get_memory(self._context)
        self._batch = llama_cpp.llama_batch_init(self.batch_size, 0, 1)
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.context_length = int(llama_cpp.llama_n_ctx(self._context))
        self.device = torch.device("cpu")
        self.length = 0

    def end_of_generation_tokens(self) -> set[int]:
        """The tokens llama.cpp treats as ending a generation (EOS, EOT and their kin)."""
        is_eog = self._api.llama_vocab_is_eog
        return {token for token in range(self.vocab_size) if is_eog(self.vocab, token)}

    def describe(self) -> str:
        """The model's own description (architecture, size, quantisation), e.g.
        ``qwen2 1.5B Q4_K - Medium``."""
        buffer = ctypes.create_string_buffer(256)
        self._api.llama_model_desc(self._model, buffer, len(buffer))
        return buffer.value.decode(errors="replace")

    def state_bytes(self) -> int:
        """The bytes of llama.cpp's context state (KV cache and output buffers)."""
        return int(self._api.llama_state_get_size(self._context))

    def reset(self) -> None:
        # The cells freed, not zeroed: a freed cell is masked until a later token overwrites it.
        self._api.llama_memory_clear(self._memory, False)
        self.length = 0

    def reserve(self, positions: int) -> None:
        """Nothing: llama.cpp's context holds :attr:`context_length` positions from the
        start."""

    def snapshot(self) -> tuple[object, int] | None:
        """llama.cpp's state of the cached positions (its sequence 0), copied out, and its
        bytes; None for an empty cache."""
        if self.length == 0:
            return None
        size = int(self._api.llama_state_seq_get_size(self._context, 0))
        buffer = (ctypes.c_uint8 * size)()
        written = int(self._api.llama_state_seq_get_data(self._context, buffer, size, 0))
        if written == 0:
            return None
        return (self.length, ctypes.string_at(buffer, written)), written  # one copy

    def restore(self, state: object, length: int) -> None:
        """Hold the first ``length`` positions of a :meth:`snapshot`'s state."""
        kept_length, data = state
        self.reset()
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(self._api.llama_state_seq_set_data(self._context, buffer, len(data), 0)) == 0:
            raise RuntimeError("llama.cpp could not restore a kept state")
        self.length = kept_length
        self.crop(length)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions, remove the rest from the KV cache."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if length < self.length:
            if not self._api.llama_memory_seq_rm(self._memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not remove KV positions from {length} on")
            self.length = length

    def forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Logits ``[num_logits, V]`` float32 for the last positions of ``input_ids``
        ``long[1, n]``, which continue the ``length`` cached positions."""
        tokens = input_ids[0].tolist()
        end = self.length + len(tokens)
        if end > self.context_length:
            raise FlyspecError(
                f"{end} tokens do not fit llama.cpp's context of {self.context_length}"
            )
        first_logit = end - num_logits
        rows: list[np.ndarray] = []
        for offset in range(0, len(tokens), self.batch_size):
            piece = tokens[offset : offset + self.batch_size]
            start = self.length
            self._fill_batch(piece, start, first_logit)
            status = self._api.llama_decode(self._context, self._batch)
            if status != 0:
                self.crop(0)
                raise RuntimeError(f"llama_decode returned {status}")
            self.length += len(piece)
            for index in range(max(0, first_logit - start), len(piece)):
                pointer = self._api.llama_get_logits_ith(self._context, index)
                rows.append(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).copy())
        return torch.from_numpy(rows[0][None] if len(rows) == 1 else np.stack(rows))  # one copy

    def _fill_batch(self, piece: Sequence[int], start: int, first_logit: int) -> None:
        batch = self._batch
        batch.n_tokens = len(piece)
        for index, token in enumerate(piece):
            position = start + index
            batch.token[index] = int(token)
            batch.pos[index] = position
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = 0
            batch.logits[index] = position >= first_logit

    def close(self) -> None:
        """Free llama.cpp's batch, context and model (also done when the object is collected)."""
        api = getattr(self, "_api", None)
        if api is None:
            return
        if getattr(self, "_batch", None) is not None:
            api.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_context", None):
            api.llama_free(self._context)
            self._context = None
        if getattr(self, "_model", None):
            api.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()


class LlamaCppLM(CachedLM):
    """A GGUF model in llama.cpp behind :class:`~flyspec.models.cache.CachedLM`, as a torch
    model is: a :class:`LlamaCppForward` (see it for the arguments) with the record of the
    token ids its cache holds. ``context_length`` is llama.cpp's context."""

    runner: LlamaCppForward

    def __init__(
        self,
        path: str | Path,
        *,
        context: int = LlamaCppConfig.context,
        threads: int = 0,
        check_binding: bool = True,
    ) -> None:
        super().__init__(
            LlamaCppForward(path, context=context, threads=threads, check_binding=check_binding)
        )

    @property
    def path(self) -> Path:
        return self.runner.path

    @property
    def threads(self) -> int:
        return self.runner.threads

    def end_of_generation_tokens(self) -> set[int]:
        """The tokens llama.cpp treats as ending a generation (EOS, EOT and their kin)."""
        return self.runner.end_of_generation_tokens()

    def describe(self) -> str:
        """The model's own description (architecture, size, quantisation)."""
        return self.runner.describe()

    def close(self) -> None:
        """Free llama.cpp's batch, context and model (also done when the model is collected)."""
        self.runner.close()


def gguf_tokenizer(path: str | Path, *, home: Path | None = None):
    """The tokenizer inside a GGUF file, as a transformers tokenizer. transformers takes about
    13 s to read one from a GGUF, so it is saved once under ``$FLYSPEC_HOME/tokenizers``, keyed
    by the file's path, size and modification time, and loaded from there (well under a
    second) afterwards."""
    import hashlib

    from transformers import AutoTokenizer

    from flyspec.models.loading import load_tokenizer
    from flyspec.support.home import flyspec_home

    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = flyspec_home(home) / "tokenizers" / f"{path.stem}-{key}"
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer = load_tokenizer(str(path))
    partial = folder.with_name(folder.name + ".partial")
    tokenizer.save_pretrained(partial)
    partial.replace(folder)
    return tokenizer


def llamacpp_identity(lm: LlamaCppLM) -> dict:
    """What a generation on ``lm`` depends on beyond the model file: the binding's version,
    the model's description, the threads and the context (caches of generated text key on it)."""
    return {
        "llamacpp": llamacpp_version(),
        "weights": lm.describe(),
        "threads": lm.threads,
        "context": lm.context_length,
    }
