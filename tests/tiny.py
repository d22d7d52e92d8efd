"""Tiny in-process models and tokenizer for fast tests (random weights, no download).

- `make_tiny_tokenizer`: a real BPE tokenizer over a small character set plus merges that build a
  few code words; encode/decode round-trips lowercase code exactly; has ``<|im_end|>`` as EOS and a
  ChatML-like chat template. Its vocabulary size is exactly `vocab_size`.
- `make_tiny_model`: a random-weight Qwen2 causal LM, deterministic by seed, in eval mode.
- `save_tiny_pair`: a draft and a target folder sharing one tokenizer, loadable with
  `flyspec.models.load_causal_lm` / `load_tokenizer`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
BASE_CHARS = tuple("abcdefghijklmnopqrstuvwxyz0123456789 \n()[]{}:,.=+-*/_'\"#<>!")
DEFAULT_SEED_WORDS = (
    "def",
    "return",
    "fibonacci",
    "if",
    "in",
    "for",
    "the",
    "print",
    "range",
    "self",
    "    ",
)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a function as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template in Qwen2.5's shape: the tools, where given, in a system turn of their own,
each call between ``<tool_call>`` tags, a tool's answer in a user turn."""
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(BASE_CHARS)


def make_tiny_tokenizer(
    vocab_size: int = 96, seed_words: Sequence[str] = DEFAULT_SEED_WORDS
) -> PreTrainedTokenizerFast:
    """A small, real BPE tokenizer with exactly `vocab_size` tokens.

    Ids: the special tokens, then single characters, then the prefixes of `seed_words` (built by
    left-to-right merges, so encoding ``fibonacci`` gives one token), then ``<extra_i>`` fillers.
    Characters outside the base set encode to ``<unk>``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *BASE_CHARS):
        vocab[token] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in seed_words:
        for end in range(2, len(word) + 1):
            if len(vocab) >= vocab_size:
                break
            left, right, merged = word[: end - 1], word[end - 1], word[:end]
            if merged in vocab or left not in vocab or right not in vocab:
                continue
            vocab[merged] = len(vocab)
            merges.append((left, right))
    filler = 0
    while len(vocab) < vocab_size:
        vocab[f"<extra_{filler}>"] = len(vocab)
        filler += 1

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(
        Regex(r" +|\n+|[a-z0-9_]+|[^a-z0-9_ \n]"), behavior="isolated"
    )
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def make_tiny_model(
    *,
    vocab_size: int,
    seed: int,
    num_layers: int = 2,
    hidden: int = 32,
    num_heads: int = 4,
    dtype: torch.dtype = torch.float32,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2ForCausalLM:
    """A random-weight Qwen2 causal LM, deterministic by `seed` (global RNG untouched), eval mode.

    Weights use a wide init (std 0.2) so logits are spread out and greedy argmax ties, which
    could flip between equivalent computations, are practically impossible.
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.to(dtype)
    model.eval()
    return model


def near_copy(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """``model`` with every weight moved by ``scale`` of its spread (seeded): a draft that
    agrees with it often, and often enough not, for FLy to keep tokens loosely (0.1 on the
    decoding tests' float64 target: loose tokens, and deferrals confirmed and rolled back)."""
    near = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in near.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * scale * parameter.std())
    return near


def save_tiny_pair(directory: Path, *, vocab_size: int = 96) -> tuple[Path, Path]:
    """Save a tiny draft (1 layer, seed 1) and target (2 layers, seed 2) sharing one tokenizer.

    Returns ``(draft_dir, target_dir)`` under `directory`.
    """
    directory = Path(directory)
    tokenizer = make_tiny_tokenizer(vocab_size)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    paths = []
    for name, seed, layers in (("draft", 1, 1), ("target", 2, 2)):
        out = directory / name
        model = make_tiny_model(vocab_size=vocab_size, seed=seed, num_layers=layers, **ids)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        paths.append(out)
    return paths[0], paths[1]


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def save_tiny_gguf(path: Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    """Write `model` (float32 tensors) and `tokenizer` as a llama.cpp-style qwen2 GGUF file.

    The tokenizer is stored as a byte-level BPE (``tokenizer.ggml.model = gpt2``), as real Qwen
    GGUFs do; transformers rebuilds it with the Qwen2 split regex, so it is a real, working
    tokenizer, though not token-for-token identical to `tokenizer` on every text.
    """
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()

    def spell(token: str) -> str:
        return "".join(spelling[b] for b in token.encode("utf-8"))

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))

    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([t if t in special else spell(t) for t in tokens])
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control, 1 = normal
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = [m.split(" ") if isinstance(m, str) else m for m in backend["model"]["merges"]]
    writer.add_token_merges([f"{spell(a)} {spell(b)}" for a, b in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_bos_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    for name, tensor in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)  # model.layers.<i>.<rest>
            gguf_name = f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"
        writer.add_tensor(gguf_name, tensor.detach().to(torch.float32).numpy())

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
