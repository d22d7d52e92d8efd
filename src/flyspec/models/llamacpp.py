"""Causal LMs run by llama.cpp (through its Python binding, ``llama-cpp-python``) behind the
interface the decoding loop uses: logits for the last n positions of a token sequence, with the
KV cache reused up to the longest common prefix and rewound past it.

The binding's low-level C API is used directly (``llama_decode`` over a batch whose last n
positions ask for logits, ``llama_memory_seq_rm`` for the rewind), so that one forward scores a
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
from flyspec.models.cache import common_prefix_length
from flyspec.models.llamacpp_binding import (
    ensure_llamacpp_decodes,
    llamacpp_version,
    require_llamacpp,
)

_BATCH = 512  # tokens per llama_decode call (a longer prompt is fed in slices)


def default_threads() -> int:
    """llama.cpp's threads: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class LlamaCppLM:
    """A GGUF model in llama.cpp with its KV cache and a record of the token ids it holds
    (the llama.cpp counterpart of :class:`~flyspec.models.cache.CachedLM`).

    :meth:`logits` takes the whole sequence each time: positions past the longest prefix shared
    with the cached tokens are removed from the KV cache, the rest are fed in one forward (in
    slices of 512 for a long prompt), and logits come back for the last ``num_logits`` only.

    ``check_binding``: first make sure, in a child process, that the binding can decode on
    this CPU (:mod:`flyspec.models.llamacpp_binding`; once per build and machine), so that a
    binding that would crash stops with a one-line error instead.
    """

    forward_path = "llamacpp"

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
        self.cached_tokens: list[int] = []
        self.forward_calls = 0

    @property
    def model(self) -> None:
        """No torch module: the weights live in llama.cpp."""
        return None

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
        """Forget everything cached (a new request)."""
        self._api.llama_memory_clear(self._memory, True)
        self.cached_tokens = []
        self.forward_calls = 0

    def rewind(self, length: int) -> None:
        """Keep the first ``length`` cached positions, remove the rest from the KV cache."""
        if not 0 <= length <= len(self.cached_tokens):
            raise ValueError(f"cannot rewind {len(self.cached_tokens)} positions to {length}")
        if length < len(self.cached_tokens):
            if not self._api.llama_memory_seq_rm(self._memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not remove KV positions from {length} on")
            del self.cached_tokens[length:]

    @torch.inference_mode()
    def logits(self, tokens: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Logits for the last ``num_logits`` positions of ``tokens``: ``[num_logits, V]``
        float32. Row ``j`` predicts the token after ``tokens[len(tokens) - num_logits + j]``."""
        if not 1 <= num_logits <= len(tokens):
            raise ValueError(f"num_logits={num_logits} for a sequence of {len(tokens)} tokens")
        if len(tokens) > self.context_length:
            raise FlyspecError(
                f"{len(tokens)} tokens do not fit llama.cpp's context of {self.context_length}"
            )
        reuse = min(common_prefix_length(self.cached_tokens, tokens), len(tokens) - num_logits)
        self.rewind(reuse)
        first_logit = len(tokens) - num_logits
        rows: list[np.ndarray] = []
        for start in range(reuse, len(tokens), self.batch_size):
            piece = tokens[start : start + self.batch_size]
            self._fill_batch(piece, start, first_logit)
            status = self._api.llama_decode(self._context, self._batch)
            if status != 0:
                self.rewind(0)
                raise RuntimeError(f"llama_decode returned {status}")
            self.cached_tokens.extend(int(t) for t in piece)
            for index in range(max(0, first_logit - start), len(piece)):
                pointer = self._api.llama_get_logits_ith(self._context, index)
                rows.append(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).copy())
        self.forward_calls += 1
        return torch.from_numpy(np.stack(rows))

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


def gguf_tokenizer(path: str | Path, *, home: Path | None = None):
    """The tokenizer inside a GGUF file, as a transformers tokenizer. transformers takes about
    13 s to read one from a GGUF, so it is saved once under ``$FLYSPEC_HOME/tokenizers``, keyed
    by the file's path, size and modification time, and loaded from there (well under a
    second) afterwards."""
    import hashlib

    from transformers import AutoTokenizer

    from flyspec.models.home import flyspec_home
    from flyspec.models.loading import load_tokenizer

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
