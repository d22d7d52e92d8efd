"""A lean forward for Llama-family decoders: the model's own modules, a preallocated KV cache,
and none of transformers' per-call machinery (mask builders, cache objects, attention dispatch).

Decoding calls a forward per draft token, so per-call overhead is paid hundreds of times per
request. Measured interleaved in one process (``benchmarks/forward_paths.py``, 2 threads, 250
cached positions): the int8 0.5B draft's one-token forward costs 60.4 ms this way against 66.4
ms through ``model(...)``, its 16-token forward 101.9 against 119.8 ms; the float32 1.5B
target's forwards are about level (0.96-1.01x over three runs: their time is in the matrix
products).

The arithmetic is the model's own: every projection, norm and MLP is called as the model holds
it (quantised or packed layers included; q, k and v through their bit-identical merged copy
where the kernels made one), rotary tables come from the model's rotary module,
and attention is ``scaled_dot_product_attention`` as in transformers' ``sdpa`` path, so logits
agree with ``model(...)`` to float rounding.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from flyspec.config import LONG_BLOCK
from flyspec.errors import error_line
from flyspec.support.console import say

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
# Rotary variants whose tables do not depend on the sequence length.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")
_MIN_CAPACITY = 256
COMPILED_SIZES = (1, 2, 4, 8, 16, 32, LONG_BLOCK + 1)
"""The forwards the compiled path runs, in new tokens: one token (a draft step), blocks of a
few sizes up to 65 (a prediction's longest block, :data:`~flyspec.config.LONG_BLOCK`, and the
token before it). On CUDA, where every
size met records a CUDA graph of its own, a forward runs at the smallest of these sizes that
holds it, padded: a few graphs whatever the block sizes chosen. Longer forwards (a prompt) run
as in eager mode."""
COMPILED_MAX_TOKENS = COMPILED_SIZES[-1]
COMPILE_CHECK_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}
"""The largest difference between the compiled and the eager forward's logits, relative to the
largest eager logit, that the first compiled forward of each kind may show (float32 rounding
of reordered arithmetic); half-precision types are allowed :data:`HALF_CHECK_TOLERANCE`. A
larger one, or a non-finite logit, means the compiled forward is wrong: it is dropped for the
eager one."""
HALF_CHECK_TOLERANCE = 5e-2


def lean_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanForward` cannot run ``model`` (None when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
    if model.training:
        return "the model is in training mode"
    inner = getattr(model, "model", None)
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, part):
            return f"the model has no model.{part}"
    if getattr(inner.rotary_emb, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rotary scaling {inner.rotary_emb.rope_type!r} depends on the sequence length"
    for layer in inner.layers:
        if not all(hasattr(layer, part) for part in _LAYER_PARTS) or not all(
            hasattr(layer.self_attn, part) for part in _ATTENTION_PARTS
        ):
            return "a decoder layer does not have the Llama layout"
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return "sliding-window attention"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention"
    devices = set(getattr(model, "hf_device_map", {}).values())
    if len(devices) > 1:
        return "the model is spread over several devices"
    return None


def output_rows(model: torch.nn.Module) -> int:
    """Rows of ``model``'s output layer (the logits'); ``out_features`` also covers packed and
    quantised layers."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


class LeanForward:
    """Forward passes over new tokens on top of a KV cache held in preallocated buffers.

    ``forward`` appends the new tokens' keys and values in place; ``crop`` only moves the
    length, so dropping a rejected draft block costs nothing. ``reserve`` sizes the buffers
    for a whole request at once (the decoder does, at its start); past what was reserved,
    they grow by doubling (:attr:`allocations` counts the times they were made).

    ``compiled``: forwards of up to :data:`COMPILED_MAX_TOKENS` new tokens (a draft step, a
    verified block) run through ``torch.compile`` as one graph from the token ids to the
    logits (:meth:`_step`), attending over the whole buffer with a mask
    so that their shapes do not change as the cache fills; on CUDA in mode ``reduce-overhead``,
    which replays each size as a CUDA graph (recorded on its first use), the sizes padded to
    ``pad_sizes`` (by default :data:`COMPILED_SIZES` on CUDA, none elsewhere). One token and
    blocks of any size compile once each for a model's shapes (seconds to minutes), whatever
    the buffers' capacity; longer forwards (a prompt) run as in eager mode. The first compiled
    forward of each kind is checked against the eager forward (:attr:`compile_checks`); where
    they differ beyond rounding, or compiling fails, the compiled forward is dropped with a
    one-line warning. Each model compiled in a process has a budget of graphs of its own
    (:func:`one_model_compiling`).
    """

    context_length = None

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compiled: bool = False,
        pad_sizes: Sequence[int] | None = None,
    ) -> None:
        reason = lean_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        self.model = model
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        # Compared here, not in the compiled layers: compiled for a second model, the head
        # counts become symbols there, and attention takes only a plain bool.
        self.grouped_query_attention = self.num_kv_heads != self.num_heads
        self.device = model.model.embed_tokens.weight.device
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)  # [capacity, head_dim]
        self.allocations = 0
        """How many times the buffers were made: the first time, and at each growth."""
        self.forward_path = "compiled" if compiled else "lean"
        self.compile_checks: dict[str, float] = {}
        """Per kind of compiled forward (``token``, ``block``): its first forward's largest
        logit difference from the eager forward, relative to the largest eager logit."""
        self._compiled_step = None
        self._graph_outputs = False
        self.pad_sizes: tuple[int, ...] = ()
        if compiled:
            on_cuda = self.device.type == "cuda"
            mode = "reduce-overhead" if on_cuda else None
            self._compiled_step = torch.compile(self._step, mode=mode, fullgraph=True)
            # CUDA graphs write their outputs where the next replay writes them again.
            self._graph_outputs = on_cuda
            chosen = COMPILED_SIZES if pad_sizes is None and on_cuda else pad_sizes or ()
            self.pad_sizes = tuple(sorted(chosen))

    @property
    def vocab_size(self) -> int:
        return output_rows(self.model)

    def reset(self) -> None:
        self.length = 0

    def state_bytes(self) -> int:
        """The bytes the KV cache's buffers hold (their capacity, not only the length used)."""
        return sum(t.nbytes for t in (*self.keys, *self.values, self.cos, self.sin))

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length

    def snapshot(self) -> tuple[object, int] | None:
        """The cached positions' keys and values, copied to host memory, and their bytes (a
        prompt cache keeps them: :mod:`flyspec.models.prompt_cache`); None for an empty
        cache."""
        if self.length == 0:
            return None
        kept = [
            [t[:, :, : self.length].to("cpu", copy=True) for t in tensors]
            for tensors in (self.keys, self.values)
        ]
        return kept, sum(t.nbytes for tensors in kept for t in tensors)

    def restore(self, state: object, length: int) -> None:
        """Hold the first ``length`` positions of a :meth:`snapshot`'s state, copied into
        the buffers (which keep their addresses where they are large enough)."""
        keys, values = state
        self._reserve(length, self.model.model.embed_tokens.weight)
        for buffers, kept in ((self.keys, keys), (self.values, values)):
            for buffer, saved in zip(buffers, kept, strict=True):
                buffer[:, :, :length].copy_(saved[:, :, :length])
        self.length = length

    def reserve(self, positions: int) -> None:
        """Buffers for ``positions`` cached positions, and the padding a compiled forward
        writes past its new tokens, made now if they are smaller: no forward up to there
        allocates (on CUDA a new buffer has a new address, which the CUDA graphs would record
        again). Larger buffers are kept."""
        margin = max(self.pad_sizes, default=1) - 1
        self._reserve(positions + margin, self.model.model.embed_tokens.weight, exact=True)

    def _reserve(self, needed: int, like: torch.Tensor, *, exact: bool = False) -> None:
        """Make room for ``needed`` positions (buffers in the dtype of ``like``): that many
        (``exact``), or twice the capacity where that is more, as a cache that grows."""
        if needed <= self.capacity:
            return
        capacity = max(needed, _MIN_CAPACITY, 0 if exact else 2 * self.capacity)
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        kept = self.length

        def grow(old: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers = []
            for index in range(len(self.model.model.layers)):
                # Zeros: the compiled path's masked attention still multiplies unwritten
                # positions' values by 0, which garbage (NaN) would survive.
                buffer = torch.zeros(shape, dtype=like.dtype, device=self.device)
                if index < len(old) and kept:
                    buffer[:, :, :kept] = old[index][:, :, :kept]
                if self._compiled_step is not None:
                    # Updated in place by the CUDA graphs, which keep its address; any
                    # capacity runs the same graph.
                    torch._dynamo.mark_static_address(buffer)
                    torch._dynamo.mark_dynamic(buffer, 2)
                buffers.append(buffer)
            return buffers

        self.keys, self.values = grow(self.keys), grow(self.values)
        self.allocations += 1
        positions = torch.arange(capacity, device=self.device)[None]
        cos, sin = self.model.model.rotary_emb(like, positions)
        self.cos, self.sin = cos[0], sin[0]
        if self._compiled_step is not None:
            torch._dynamo.mark_dynamic(self.cos, 0)
            torch._dynamo.mark_dynamic(self.sin, 0)
        self.capacity = capacity

    def _project_qkv(
        self, attention: torch.nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[1, heads, n, head_dim]``, keys and values ``[1, kv_heads, n, head_dim]``
        of ``x`` ``[1, n, D]``, through the merged projection where the kernels made one
        (:func:`flyspec.models.kernels.merge_int8_projections`)."""
        n = x.shape[1]
        merged = getattr(attention, "merged_qkv_proj", None)
        if merged is None:
            projected = (attention.q_proj(x), attention.k_proj(x), attention.v_proj(x))
        else:
            kv_width = self.num_kv_heads * self.head_dim
            widths = (self.num_heads * self.head_dim, kv_width, kv_width)
            projected = merged(x).split(widths, dim=-1)
        return tuple(p.view(1, n, -1, self.head_dim).transpose(1, 2) for p in projected)

    def forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Logits ``[num_logits, V]`` for the last positions of ``input_ids`` ``long[1, n]``,
        which continue the ``length`` cached positions."""
        n = input_ids.shape[1]
        if self._compiled_step is not None and n <= COMPILED_MAX_TOKENS:
            return self._compiled_forward(input_ids, num_logits)
        start, end = self.length, self.length + n
        hidden = self.model.model.embed_tokens(input_ids)  # [1, n, D]
        self._reserve(end, hidden)
        positions = torch.arange(start, end, device=self.device)
        if n > 1 and start > 0:
            # New token i sees every cached position and the new tokens up to itself.
            visible = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
            hidden = self._layers(hidden, positions, visible, end)
        else:  # one token, or an empty cache: plain causal attention, a faster kernel
            hidden = self._layers(hidden, positions, None, end)
        self.length = end
        return self._logits(hidden, num_logits)

    def _logits(self, hidden: torch.Tensor, num_logits: int) -> torch.Tensor:
        """``[num_logits, V]`` from the last layer's ``hidden`` states ``[1, n, D]``."""
        return self._head(hidden[:, -num_logits:])

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, V]``: the final norm and the head over ``hidden`` ``[1, n, D]``."""
        return self.model.get_output_embeddings()(self.model.model.norm(hidden))[0]

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of the new tokens ``input_ids`` ``long[n]`` at ``positions``
        ``long[n]``: the embedding, the layers attending over every buffered position with
        those past each token masked (shapes that do not change as the cache fills), the
        final norm and the head. The compiled forward's one graph."""
        hidden = self.model.model.embed_tokens(input_ids)[None]  # [1, n, D]
        buffered = torch.arange(self.keys[0].shape[2], device=positions.device)
        visible = buffered <= positions[:, None]  # [n, capacity]
        return self._head(self._layers(hidden, positions, visible, None))

    def _compiled_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, n: int, num_logits: int
    ) -> torch.Tensor:
        """The compiled step's logits of the last ``num_logits`` of the ``n`` new tokens (of
        ``input_ids``, padded past them), copied out of a CUDA graph's output, which the
        graph's next replay overwrites."""
        logits = self._compiled_step(input_ids, positions)[n - num_logits : n]
        return logits.clone() if self._graph_outputs else logits

    def _compiled_forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """:meth:`forward` through the compiled :meth:`_step`, at the padded size: the
        padding's keys and values land past the new tokens, where nothing sees them before a
        later forward overwrites them. Where compiling fails, whatever the error, this forward
        and every later one run eagerly, said in one line."""
        n = input_ids.shape[1]
        size = next((s for s in self.pad_sizes if s >= n), n)
        # One dimension: a row cut from a wider tensor keeps that tensor's strides in two,
        # which the graph's guards would take for another input.
        padded = input_ids.reshape(n)
        if size > n:
            padded = torch.cat((padded, padded[-1:].expand(size - n)))
        elif torch.is_inference_mode_enabled() and not input_ids.is_inference():
            # Made outside inference mode (a drafter's choice): to the graph another kind of
            # tensor than the inputs made inside it, for which it would compile again.
            padded = padded.clone()
        start = self.length
        self._reserve(start + size, self.model.model.embed_tokens.weight)
        positions = torch.arange(start, start + size, device=self.device)
        self._mark_dynamic(padded, positions)
        kind = "token" if size == 1 else "block"
        try:
            if kind in self.compile_checks:
                logits = self._compiled_logits(padded, positions, n, num_logits)
            else:
                logits = self._first_compiled(kind, padded, positions, n, num_logits)
        except Exception as error:  # noqa: BLE001 - any failure to compile runs eagerly
            self._drop_compiled(f"could not compile it ({error_line(error, limit=200)})")
            return self.forward(input_ids, num_logits)  # the cache's values written again
        self.length = start + n
        return logits

    def _drop_compiled(self, reason: str) -> None:
        """Run every later forward eagerly, saying why on stderr in one line."""
        say(f"warning: {self._name()}'s compiled forward: {reason}; running eagerly")
        self._compiled_step = None
        self.forward_path = "lean"

    def _name(self) -> str:
        """The model's name: its folder's or hub id's last part, else its type."""
        path = getattr(self.model.config, "_name_or_path", "") or self.model.config.model_type
        return path.rstrip("/").rsplit("/", 1)[-1]

    def _first_compiled(
        self,
        kind: str,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        n: int,
        num_logits: int,
    ) -> torch.Tensor:
        """The first compiled forward of ``kind``, said on stderr (it compiles), checked
        against the same forward run eagerly: where the two differ beyond rounding, the
        compiled forward is dropped."""
        name = self._name()
        say(f"compiling {name}'s forward ({'one token' if kind == 'token' else 'blocks'}) ...")
        started = time.perf_counter()
        eager = self._step(input_ids, positions)[n - num_logits : n]
        # The compiled step writes the same positions again: the cache holds their values.
        with one_model_compiling():
            logits = self._compiled_logits(input_ids, positions, n, num_logits)
        scale = eager.abs().max().clamp_min(torch.finfo(eager.dtype).tiny)
        difference = float((logits - eager).abs().max() / scale)
        self.compile_checks[kind] = difference
        tolerance = COMPILE_CHECK_TOLERANCE.get(eager.dtype, HALF_CHECK_TOLERANCE)
        seconds = time.perf_counter() - started
        if math.isfinite(difference) and difference <= tolerance:
            say(f"compiled {name}'s forward in {seconds:.0f} s")
            return logits
        self._drop_compiled(
            f"differs from the eager one ({difference:.2g} of the largest logit, over "
            f"{tolerance:.2g} allowed in {eager.dtype})"
        )
        self._step(input_ids, positions)  # the eager values back in the cache
        return eager

    def _mark_dynamic(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Let the compiled step take blocks of any size (the buffers, whose capacity may
        change, are marked when made): a graph for one token and one for blocks, not one per
        size met, within dynamo's limit of recompilations per function."""
        if input_ids.shape[0] > 1:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)

    def _layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor | None,
        key_length: int | None,
    ) -> torch.Tensor:
        """The decoder layers over the new tokens' ``hidden`` states ``[1, n, D]`` at
        ``positions`` ``long[n]``: their keys and values go into the buffers, and each attends
        to the first ``key_length`` buffered positions (None: all of them) where ``visible``
        ``bool[n, key_length]`` allows (None: causally, which on an empty cache is the
        same)."""
        n = hidden.shape[1]
        cos = self.cos[positions]  # [n, head_dim], broadcast over [1, heads, n, head_dim]
        sin = self.sin[positions]
        half = self.head_dim // 2

        def rotate(x: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        for index, layer in enumerate(self.model.model.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = self._project_qkv(attention, x)
            self.keys[index].index_copy_(2, positions, rotate(k))
            self.values[index].index_copy_(2, positions, v)
            attended = F.scaled_dot_product_attention(
                rotate(q),
                self.keys[index][:, :, :key_length],
                self.values[index][:, :, :key_length],
                attn_mask=visible,
                is_causal=visible is None and n > 1,
                scale=attention.scaling,
                enable_gqa=self.grouped_query_attention,
            )  # [1, heads, n, head_dim]
            hidden = hidden + attention.o_proj(attended.transpose(1, 2).reshape(1, n, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden


GRAPHS_PER_MODEL = 8
"""The graphs each compiled model may add, whatever came before it in the process: dynamo's
own default limit for one function."""


def one_model_compiling() -> contextlib.AbstractContextManager:
    """dynamo's settings for a model's first compile of a kind, the first of them for good.

    - A budget of graphs per model. dynamo caps the graphs it keeps for one function's code
      (``recompile_limit``, 8 by default), and every :class:`LeanForward` compiles the same
      function, :meth:`LeanForward._layers`: models of other shapes or dtypes need graphs of
      their own (two each: one token, and blocks), so under the default cap the fifth such
      model in a process would fail to compile. Before each model's first compile, the cap is
      raised (never lowered) to what the process has compiled (every graph counted: an upper
      bound of ours) plus :data:`GRAPHS_PER_MODEL`. It stays raised, for the graphs a model
      may need later (a caller's torch function mode, say, is another graph).
    - No automatic dynamic shapes, while the model compiles (a patch sets and restores the
      setting in Python, work no forward should repeat). The sizes that vary (the buffers'
      capacity, a block's length) are marked dynamic where the inputs are made; a second
      model of another width gets graphs of its own sizes, not graphs made symbolic in it.
    """
    from torch._dynamo.utils import counters

    config = torch._dynamo.config
    limit = counters["stats"]["unique_graphs"] + GRAPHS_PER_MODEL
    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, limit)
    return config.patch(automatic_dynamic_shapes=False)
