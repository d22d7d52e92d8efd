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

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
# Rotary variants whose tables do not depend on the sequence length.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")
_MIN_CAPACITY = 256


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
    length, so dropping a rejected draft block costs nothing. Buffers grow by doubling.
    """

    forward_path = "lean"
    context_length = None

    def __init__(self, model: torch.nn.Module) -> None:
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
        self.device = model.model.embed_tokens.weight.device
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)  # [capacity, head_dim]

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

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        """Make room for ``needed`` positions (buffers in the dtype of ``like``)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, _MIN_CAPACITY)
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        kept = self.length

        def grow(old: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers = []
            for index in range(len(self.model.model.layers)):
                buffer = torch.empty(shape, dtype=like.dtype, device=self.device)
                if index < len(old) and kept:
                    buffer[:, :, :kept] = old[index][:, :, :kept]
                buffers.append(buffer)
            return buffers

        self.keys, self.values = grow(self.keys), grow(self.values)
        positions = torch.arange(capacity, device=self.device)[None]
        cos, sin = self.model.model.rotary_emb(like, positions)
        self.cos, self.sin = cos[0], sin[0]
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
        inner = self.model.model
        n = input_ids.shape[1]
        start, end = self.length, self.length + n
        hidden = inner.embed_tokens(input_ids)  # [1, n, D]
        self._reserve(end, hidden)
        cos = self.cos[start:end]  # [n, head_dim], broadcast over [1, heads, n, head_dim]
        sin = self.sin[start:end]
        half = self.head_dim // 2

        def rotate(x: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        # New token i sees every cached position and the new tokens up to itself. On an empty
        # cache that is plain causal attention, which has a faster kernel than a mask.
        mask = None
        if n > 1 and start > 0:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = self._project_qkv(attention, x)
            self.keys[index][:, :, start:end] = rotate(k)
            self.values[index][:, :, start:end] = v
            attended = F.scaled_dot_product_attention(
                rotate(q),
                self.keys[index][:, :, :end],
                self.values[index][:, :, :end],
                attn_mask=mask,
                is_causal=n > 1 and start == 0,
                scale=attention.scaling,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # [1, heads, n, head_dim]
            hidden = hidden + attention.o_proj(attended.transpose(1, 2).reshape(1, n, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.length = end
        hidden = inner.norm(hidden[:, -num_logits:])
        return self.model.get_output_embeddings()(hidden)[0]
