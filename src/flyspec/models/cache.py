"""A causal LM paired with its KV cache: :class:`CachedLM` over a forward runner, torch's two
(:class:`TransformersForward`, :class:`~flyspec.models.lean.LeanForward`) or llama.cpp's
(:class:`~flyspec.models.llamacpp.LlamaCppForward`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import DynamicCache

from flyspec.config import FORWARD_PATHS
from flyspec.errors import FlyspecError
from flyspec.models.lean import LeanForward, lean_unsupported_reason, output_rows
from flyspec.models.prompt_cache import PromptCache, common_prefix_length


def token_tensor(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``long[1, n]`` on ``device``. On CUDA the copy goes through pinned memory without
    waiting: from pageable memory it would block the host until the device has run everything
    queued before it."""
    tensor = torch.tensor([list(token_ids)], dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class DeviceTokens:
    """A token sequence held twice, equal position by position: as a Python list (``ids``,
    what drafters and the host's checks read) and in a buffer on ``device`` (what forwards
    and blocks are cut from). The device copy is written by device operations from the
    tokens the device chose (the verdict's, a step's), so that a round's forward takes its
    input without a copy from the host: on CUDA such a copy waits for the queued work,
    unless pinned, and pinning costs as much again. Tokens known only on the host are
    copied in (the prompt, a drawn token). The buffer is made and written in inference mode,
    as every forward runs: its slices are then the same kind of tensor as the other inputs of a
    compiled forward, which would otherwise compile its graphs again for them."""

    @torch.inference_mode()
    def __init__(self, ids: Sequence[int], *, device: torch.device, capacity: int = 0) -> None:
        self.ids: list[int] = list(ids)
        self.device = device
        self.version = 0
        """Changed by every change of the sequence (what is counted from it can be kept
        until then)."""
        self._buffer = torch.empty(max(capacity, len(self.ids), 1), dtype=torch.long, device=device)
        if self.ids:
            self._buffer[: len(self.ids)] = token_tensor(self.ids, device)[0]

    def __len__(self) -> int:
        return len(self.ids)

    @torch.inference_mode()
    def extend(self, tokens: Sequence[int], on_device: torch.Tensor | None = None) -> None:
        """Append ``tokens``; ``on_device`` ``long[len(tokens)]``: the same tokens on the
        device (None: copied from the host)."""
        if not tokens:
            return
        start, end = len(self.ids), len(self.ids) + len(tokens)
        if end > self._buffer.shape[0]:
            grown = torch.empty(2 * end, dtype=torch.long, device=self.device)
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        if on_device is None:
            on_device = token_tensor(tokens, self.device)[0]
        self._buffer[start:end] = on_device.reshape(-1)
        self.ids.extend(tokens)
        self.version += 1

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        del self.ids[length:]
        self.version += 1

    def find(self, tokens: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        """``long[end - start]`` on the device: positions ``start..end-1`` of ``tokens``, where
        they are those of this sequence (compared on the host), else None."""
        if end > len(self.ids) or list(tokens[start:end]) != self.ids[start:end]:
            return None
        return self.span(start, end)

    def span(self, start: int, end: int) -> torch.Tensor:
        """``long[end - start]``: positions ``start..end-1`` on the device."""
        if not 0 <= start <= end <= len(self.ids):
            raise ValueError(f"positions {start}..{end} outside a sequence of {len(self.ids)}")
        return self._buffer[start:end]


def read_later(value: torch.Tensor) -> Callable[[], int]:
    """Start reading the one-element ``value`` into Python without waiting: the function
    returned waits for that value alone and gives it. On CUDA it is copied to pinned memory
    behind an event, so work queued after it (the next step, launched from ``value`` before
    the host reads it) does not delay the read; elsewhere it is read when asked."""
    if value.device.type != "cuda":
        return lambda: int(value)
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value.reshape(()), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> int:
        copied.synchronize()
        return int(host)

    return read


class ForwardRunner(Protocol):
    """Forward passes over new tokens on top of a KV cache the runner holds, and the cuts of
    that cache: what :class:`CachedLM` drives."""

    forward_path: str
    """``lean``, ``compiled``, ``transformers`` or ``llamacpp``."""
    model: torch.nn.Module | None
    """The torch module it runs (None: the weights live outside torch)."""
    device: torch.device
    """Where input ids go and logits come back."""
    context_length: int | None
    """The most positions the cache can hold (None: no fixed limit)."""

    @property
    def length(self) -> int:
        """Positions the cache holds."""
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (ValueError past the cache's length)."""
        ...

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` cached positions at once, so that no forward up to
        there allocates (where the cache is preallocated; else nothing)."""
        ...

    def forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Logits ``[num_logits, V]`` for the last positions of ``input_ids`` ``long[1, n]``,
        which continue the ``length`` cached positions."""
        ...

    def state_bytes(self) -> int:
        """The bytes the cache holds."""
        ...

    def snapshot(self) -> tuple[object, int] | None:
        """A copy of the cached positions' state in host memory, and its bytes (None: none
        can be taken, or the cache is empty)."""
        ...

    def restore(self, state: object, length: int) -> None:
        """Hold the first ``length`` positions of a :meth:`snapshot`'s ``state``."""
        ...


class TransformersForward:
    """Forward passes through ``model(...)`` with a transformers ``DynamicCache``: runs any
    causal LM (the fallback where :class:`~flyspec.models.lean.LeanForward` cannot)."""

    forward_path = "transformers"
    context_length = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()
        # transformers 5.24 names the cache argument ``cache``; earlier 5.x ``past_key_values``.
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def vocab_size(self) -> int:
        return output_rows(self.model)

    def reset(self) -> None:
        self.cache = DynamicCache()

    def state_bytes(self) -> int:
        """The bytes the KV cache holds."""
        return sum(
            t.nbytes
            for layer in getattr(self.cache, "layers", [])
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)
        )

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions.

        transformers 5.24 takes the number of positions to *remove*, as a negative number (a
        positive absolute length raises); the earlier 5.x releases read a negative argument the
        same way.
        """
        current = self.length
        if not 0 <= length <= current:
            raise ValueError(f"cannot crop a cache of {current} positions to {length}")
        if length < current:
            self.cache.crop(length - current)

    def reserve(self, positions: int) -> None:
        """Nothing: transformers' cache grows as it goes."""

    def snapshot(self) -> None:
        """None: transformers' cache layouts differ from release to release; the lean forward
        and llama.cpp keep theirs."""
        return None

    def restore(self, state: object, length: int) -> None:
        raise NotImplementedError("transformers' forward takes no snapshot to restore")

    def forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids,
            use_cache=True,
            logits_to_keep=num_logits,
            **{self.cache_argument: self.cache},  # updated in place
        )
        return output.logits[0, -num_logits:]


def make_forward(model: torch.nn.Module, path: str = "auto") -> TransformersForward | LeanForward:
    """The forward runner for ``model``: ``lean`` where the architecture allows it (else
    transformers'), ``compiled`` (the lean forward through ``torch.compile``; FlyspecError
    where the lean forward cannot run the model), ``auto`` (compiled for a model on CUDA, lean
    elsewhere) or ``transformers``."""
    if path not in FORWARD_PATHS:
        raise ValueError(f"forward path must be one of {', '.join(FORWARD_PATHS)}, got {path!r}")
    reason = lean_unsupported_reason(model)
    if path == "auto":
        on_cuda = next(model.parameters()).device.type == "cuda"
        path = "compiled" if on_cuda and reason is None else "lean"
    if path == "compiled" and reason is not None:
        raise FlyspecError(f"the compiled forward runs what the lean forward runs: {reason}")
    if path in ("lean", "compiled") and reason is None:
        return LeanForward(model, compiled=path == "compiled")
    return TransformersForward(model)


class LanguageModel(Protocol):
    """What the decoding loop and the drafters need of a model: logits for the last positions
    of a token sequence, reusing what it cached of an earlier one. :class:`CachedLM` follows
    it, over torch's forwards or llama.cpp's."""

    device: torch.device
    forward_path: str
    forward_calls: int
    vocab_size: int
    """Rows of the logits."""
    cached_tokens: list[int]
    """The token ids whose positions the cache holds."""
    context_length: int | None
    """The most positions the cache can hold (None: no fixed limit)."""

    def logits(self, tokens: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """``[num_logits, V]``: row ``j`` predicts the token after
        ``tokens[len(tokens) - num_logits + j]``."""
        ...

    def use_prompt_cache(self, prompts: PromptCache | None, *, name: str) -> None:
        """Keep and restore states in ``prompts`` under ``name`` (None: none)."""
        ...

    def keep(self) -> None:
        """Put the cache's state in the prompt cache (the end of a request)."""
        ...

    def prefill(self, tokens: Sequence[int]) -> int:
        """Have the cache hold ``tokens``, which the next forward continues (no logits); the
        positions it did not compute (held from before)."""
        ...

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits ``[V]`` for the token after ``token`` ``long[1]`` (on :attr:`device`), which
        continues the tokens last given, without reading it back from the device."""
        ...

    def logits_with_block(self, context: Sequence[int], block: torch.Tensor) -> torch.Tensor:
        """``[n + 1, V]``: logits for the last token of ``context`` and each token of
        ``block`` ``long[n]`` (a draft block still on the device, unread)."""
        ...

    def record_steps(self, tokens: Sequence[int]) -> None:
        """The ids of the tokens :meth:`step` was fed since they were last read, as the caller
        read them back: the record of the cache then needs no read of its own."""
        ...

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` cached positions at once (a request's prompt, its token
        budget and its largest block): no forward of the request then reallocates the
        cache."""
        ...

    def follow(self, source: DeviceTokens | None) -> None:
        """Take the new tokens of a forward from ``source`` (a request's context on the
        device) where it holds them, instead of copying them from the host."""
        ...

    def reset(self) -> None:
        """Forget everything cached (a new request)."""
        ...

    def state_bytes(self) -> int:
        """The bytes the model's cache holds."""
        ...


class CachedLM:
    """A causal LM's forward runner with a record of the token ids its cache holds.

    :meth:`logits` takes the *whole* sequence each time and reuses the longest cached prefix,
    so callers never track cache positions: after a block is verified, the next call with the
    committed sequence crops away the rejected positions by itself.

    ``model``: a torch module, run by the runner ``forward_path`` names
    (:func:`make_forward`), or a :class:`ForwardRunner` as it is.
    """

    def __init__(
        self, model: torch.nn.Module | ForwardRunner, *, forward_path: str = "auto"
    ) -> None:
        self.runner: ForwardRunner = (
            make_forward(model, forward_path) if isinstance(model, torch.nn.Module) else model
        )
        self.model = self.runner.model
        self.device = self.runner.device
        self.context_length: int | None = self.runner.context_length
        self.forward_calls = 0
        self._tokens: list[int] = []
        self._unread: list[torch.Tensor] = []  # long[n] each: fed by step() or a block, unread
        self._source: DeviceTokens | None = None
        self._prompts: PromptCache | None = None
        self._name = "model"

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def forward_path(self) -> str:
        return self.runner.forward_path

    @property
    def cached_tokens(self) -> list[int]:
        """The token ids whose positions the runner's cache holds (those :meth:`step` fed are
        read from the device here, all at once)."""
        if self._unread:
            self._tokens += torch.cat(self._unread).tolist()
            self._unread = []
        return self._tokens[: self.runner.length]

    def state_bytes(self) -> int:
        """The bytes of the KV cache (kept between requests, so after the longest one its
        largest)."""
        return self.runner.state_bytes()

    @torch.inference_mode()
    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` cached positions at once (:meth:`ForwardRunner.reserve`),
        in inference mode as every forward is: buffers made outside it would be other tensors
        to the compiled forward's guards, which would compile its graphs again."""
        self.runner.reserve(positions)

    def reset(self) -> None:
        """Forget everything cached (a new request)."""
        self.runner.reset()
        self._tokens = []
        self._unread = []
        self.forward_calls = 0

    def use_prompt_cache(self, prompts: PromptCache | None, *, name: str) -> None:
        """Keep states in ``prompts`` (:meth:`keep`) and restore them at :meth:`prefill`,
        under ``name`` (the model's role: ``target``, ``draft``); None: neither."""
        self._prompts, self._name = prompts, name

    def keep(self) -> None:
        """Put the cache's state in the prompt cache, keyed by the tokens it holds (at the
        end of a request); nothing where there is none, or it holds those tokens already."""
        if self._prompts is None:
            return
        tokens = self.cached_tokens
        if not tokens or self._prompts.holds(self._name, tokens):
            return
        taken = self.runner.snapshot()
        if taken is not None:
            self._prompts.put(self._name, tokens, *taken)

    def follow(self, source: DeviceTokens | None) -> None:
        """Take the new tokens of a forward from ``source`` (a request's context on the
        device) wherever they are its tokens at the same positions, instead of copying them
        from the host; None: always from the host."""
        self._source = source

    @property
    def source(self) -> DeviceTokens | None:
        """The sequence it follows (:meth:`follow`)."""
        return self._source

    @torch.inference_mode()
    def logits(self, tokens: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Logits for the last ``num_logits`` positions of ``tokens``: ``[num_logits, V]``.

        Row ``j`` predicts the token after ``tokens[len(tokens) - num_logits + j]``.
        """
        if not 1 <= num_logits <= len(tokens):
            raise ValueError(f"num_logits={num_logits} for a sequence of {len(tokens)} tokens")
        return self._forward(tokens, num_logits)

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int]) -> int:
        """Have the cache hold ``tokens``, a prompt that the next forward continues: one
        forward over what it does not hold of them, and none where it holds them all (a
        prompt the request before left cached: its logits are not wanted, and reading its
        last position again for them would cost a forward). With a prompt cache, a kept state
        that shares more of them than the live cache is restored first. The positions it
        did not compute (held or restored)."""
        held = common_prefix_length(self.cached_tokens, tokens)
        if held < len(tokens) and self._prompts is not None:
            held = self._restore(tokens, held)
        if held < len(tokens):
            self._forward(tokens, 1)
            return min(held, len(tokens) - 1)
        self.runner.crop(len(tokens))
        self._tokens = list(tokens)
        return len(tokens)

    def _restore(self, tokens: Sequence[int], held: int) -> int:
        """Restore the kept state that shares more of ``tokens`` than the ``held`` positions
        of the live cache, where there is one; the positions held after."""
        found = self._prompts.best(self._name, tokens)
        if found is None or found[1] <= held:
            return held
        kept, shared = found
        self.runner.restore(kept.state, shared)
        self._tokens, self._unread = list(kept.tokens[:shared]), []
        self._prompts.restored_tokens += shared - held
        return shared

    @torch.inference_mode()
    def logits_with_block(
        self, context: Sequence[int], block: torch.Tensor, *, ids: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Logits ``[n + 1, V]`` for the last token of ``context`` and each token of
        ``block`` ``long[n]``, a draft block on the device. ``ids``: its tokens as the host
        knows them; without them it is fed unread, and recorded as such until its ids are
        read (:attr:`cached_tokens`) or given (:meth:`record_steps`). One forward, as
        :meth:`logits` over the whole sequence."""
        if not context:
            raise ValueError("the block continues a context: give at least one token")
        block = block.reshape(-1).to(self.device, non_blocking=True)
        return self._forward(context, 1, block=block, block_ids=ids)

    def _forward(
        self,
        tokens: Sequence[int],
        fresh: int,
        *,
        block: torch.Tensor | None = None,
        block_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One forward over what the cache does not hold of ``tokens`` (their last ``fresh``
        at least) and then ``block`` (on the device; its ``block_ids``, or recorded unread):
        the logits of those last ``fresh`` positions and of the block's,
        ``[fresh + len(block), V]``."""
        reuse = min(common_prefix_length(self.cached_tokens, tokens), len(tokens) - fresh)
        self.runner.crop(reuse)
        self._tokens = list(tokens)
        new_tokens = self._new_tokens(tokens, reuse)
        num_logits = fresh
        if block is not None:
            if block_ids is None:
                self._unread = [block]
            else:
                self._tokens += block_ids
            new_tokens = torch.cat((new_tokens[0], block))[None]
            num_logits += block.shape[0]
        logits = self.runner.forward(new_tokens, num_logits)
        self.forward_calls += 1
        return logits

    def _new_tokens(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """``long[1, n]`` on the device: ``tokens[start:]``, from the followed sequence where
        it holds them, else from the host."""
        if self._source is not None:
            found = self._source.find(tokens, start, len(tokens))
            if found is not None:
                return found.to(self.device, non_blocking=True)[None]
        return token_tensor(tokens[start:], self.device)

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits ``[V]`` for the token after ``token`` ``long[1]`` (on :attr:`device`), which
        continues the tokens last given: a drafter's one-token step. The token stays on the
        device, unread until :attr:`cached_tokens` is next needed (or the caller gives the ids it
        read, :meth:`record_steps`), so that a block of steps costs no host synchronisation
        per token."""
        if not self._tokens and not self._unread:
            raise ValueError("step() continues a sequence: call logits() first")
        self._unread.append(token.reshape(1))
        logits = self.runner.forward(token.reshape(1, 1), 1)
        self.forward_calls += 1
        return logits[0]

    def record_steps(self, tokens: Sequence[int]) -> None:
        """The ids of the tokens :meth:`step` was fed since they were last read, as the caller
        read them back (a drafter reads its block anyway): the record of the cache then needs
        no read of its own at the next :meth:`logits`."""
        unread = sum(t.numel() for t in self._unread)
        if len(tokens) != unread:
            raise ValueError(f"{unread} stepped tokens are unread, {len(tokens)} given")
        self._tokens += tokens
        self._unread = []
