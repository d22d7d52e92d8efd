"""The models the run builds: random weights in the shapes of the default pair (Qwen2.5-Coder
0.5B drafting, 1.5B target) and of a 7B and a 32B Qwen2.5 target (``gpu_configs/*/config.json``),
as they are, narrowed for the rehearsal or shrunk to one tiny shape; what a one-token forward
reads; and the ``model`` rows: each model built, its size and a check that its logits are
finite."""

from __future__ import annotations

import gc

import torch

from flyspec.models.cache import CachedLM

from . import BENCHMARKS
from .table import Row, fmt_count

CONFIGS = BENCHMARKS / "gpu_configs"

DRAFT = "0.5b"

MODELS = {
    DRAFT: "qwen2.5-coder-0.5b-instruct",
    "1.5b": "qwen2.5-coder-1.5b-instruct",
    "7b": "qwen2.5-7b-instruct",
    "32b": "qwen2.5-32b-instruct",
}

TARGETS = ("1.5b", "7b", "32b")

TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}

REHEARSAL_WIDTH_DIVISOR = 16
"""``--rehearse``: every model with its real layers, heads, key-value heads and vocabulary, its
hidden and MLP widths divided by this (head dimensions of 4 and 8 instead of 64 and 128): a
shape of its own for each model, as on the GPU, so that a CPU compiles what the GPU would."""

SHAPES = ("real", "rehearsal", "tiny")


def load_config(name: str, *, shapes: str):
    """The shipped config of model ``name`` (``MODELS``): as it is (``real``), narrowed
    (``rehearsal``: :data:`REHEARSAL_WIDTH_DIVISOR`) or shrunk (``tiny``: :data:`TINY_SHAPE`)."""
    from transformers import AutoConfig

    path = CONFIGS / MODELS[name]
    if shapes == "tiny":
        return AutoConfig.from_pretrained(path, **TINY_SHAPE)
    if shapes == "rehearsal":
        real = AutoConfig.from_pretrained(path)
        narrowed = {
            key: getattr(real, key) // REHEARSAL_WIDTH_DIVISOR
            for key in ("hidden_size", "intermediate_size")
        }
        return AutoConfig.from_pretrained(path, **narrowed)
    return AutoConfig.from_pretrained(path)


def build_model(config, *, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A random-weight causal LM of ``config``, created on ``device`` in ``dtype`` (transformers'
    own initialisation: normal weights of std ``initializer_range``, unit norms) from
    ``seed`` (models of one shape, as in the tiny form, differ by their seeds)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def bytes_per_token(model: torch.nn.Module, context: int) -> tuple[int, int]:
    """What a one-token forward reads: the weights (all but the input embedding table, of
    which it reads one row, unless the table is also the output head) and the KV cache of
    ``context`` positions. ``-> (weight bytes, KV bytes)``."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        weights -= embedding.numel() * embedding.element_size()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_key_value_heads * head_dim * embedding.element_size()
    return weights, config.num_hidden_layers * per_position * context


def model_row(name: str, model: torch.nn.Module, context: int, seconds: float) -> Row:
    """The model built: its size, what a one-token forward reads, and finite logits."""
    prompt = torch.randint(model.config.vocab_size, (8,), generator=torch.Generator()).tolist()
    logits = CachedLM(model, forward_path="lean").logits(prompt, 1)
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("the random weights give non-finite logits")
    weights, kv = bytes_per_token(model, context)
    parameters = sum(p.numel() for p in model.parameters())
    config = model.config
    return Row(
        "model",
        f"{name} ({MODELS[name]})",
        "ok",
        f"{fmt_count(parameters, 'parameters')}, {fmt_count(weights, 'B')} read per token",
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}; KV cache of {context} positions {fmt_count(kv, 'B')}; built in "
        f"{seconds:.1f} s; logits finite",
        {"parameters": parameters, "weight_bytes": weights, "kv_bytes": kv, "build_s": seconds},
    )


def random_prompt(vocab_size: int, length: int, *, seed: int = 1) -> list[int]:
    """Token ids of a prompt (the costs do not depend on them)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (length,), generator=generator).tolist()


def release_memory(device: torch.device) -> None:
    """Give the freed device memory back before the next, possibly larger, model."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
