"""The child process of the llama.cpp decode check (:mod:`flyspec.models.llamacpp_binding`):
a tiny model of random weights, quantised by the binding to Q4_K_M (the default pair's
quantisation, so that the kernels a real model runs are the ones tried, AMX's included), then
one decode of 1 token and one of 16. Exit status 0 when the logits are finite; a crash kills
only this process."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from flyspec.models.llamacpp import LlamaCppLM
from flyspec.models.llamacpp_binding import require_llamacpp

_HIDDEN, _FFN, _HEADS, _KV_HEADS, _VOCAB = 256, 512, 4, 2, 300
"""The tiny model: rows of 256 (a K-quant's block) so that every weight is quantised."""
_LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def write_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """A one-layer qwen2 model of random float32 weights with a byte-level vocabulary of
    :data:`_VOCAB` tokens, as a GGUF file."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    head_dim = _HIDDEN // _HEADS

    def weight(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("flyspec-decode-check")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    byte_tokens = _byte_level_spellings()
    tokens = byte_tokens + [f"<extra_{i}>" for i in range(_VOCAB - len(byte_tokens) - 1)]
    tokens.append("<|endoftext|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (_VOCAB - 1) + [3])  # 3: a control token
    writer.add_token_merges([f"{byte_tokens[32]} {byte_tokens[32]}"])
    writer.add_eos_token_id(_VOCAB - 1)
    ones = np.ones(_HIDDEN, dtype=np.float32)
    kv = _KV_HEADS * head_dim
    tensors = {
        "token_embd.weight": weight(_VOCAB, _HIDDEN),
        "output_norm.weight": ones,
        "output.weight": weight(_VOCAB, _HIDDEN),
        "blk.0.attn_norm.weight": ones,
        "blk.0.attn_q.weight": weight(_HIDDEN, _HIDDEN),
        "blk.0.attn_q.bias": np.zeros(_HIDDEN, dtype=np.float32),
        "blk.0.attn_k.weight": weight(kv, _HIDDEN),
        "blk.0.attn_k.bias": np.zeros(kv, dtype=np.float32),
        "blk.0.attn_v.weight": weight(kv, _HIDDEN),
        "blk.0.attn_v.bias": np.zeros(kv, dtype=np.float32),
        "blk.0.attn_output.weight": weight(_HIDDEN, _HIDDEN),
        "blk.0.ffn_norm.weight": ones,
        "blk.0.ffn_gate.weight": weight(_FFN, _HIDDEN),
        "blk.0.ffn_up.weight": weight(_FFN, _HIDDEN),
        "blk.0.ffn_down.weight": weight(_HIDDEN, _FFN),
    }
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_level_spellings() -> list[str]:
    """The 256 byte-level BPE symbols: printable Latin-1 bytes stand for themselves, the
    others for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[byte] for byte in range(256)]


def decode_check() -> None:
    """Quantise a tiny model with the binding, decode 1 then 16 tokens, check the logits."""
    import numpy as np

    llama_cpp = require_llamacpp()
    with tempfile.TemporaryDirectory(prefix="flyspec-llamacpp-check-") as folder:
        source = write_tiny_gguf(Path(folder) / "tiny-f32.gguf")
        quantised = Path(folder) / "tiny-q4_k_m.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = _LLAMA_FTYPE_MOSTLY_Q4_K_M
        if llama_cpp.llama_model_quantize(str(source).encode(), str(quantised).encode(), params):
            raise SystemExit("llama_model_quantize failed")
        lm = LlamaCppLM(quantised, context=64, check_binding=False)
        prompt = list(range(40, 57))
        one = lm.logits(prompt[:2], 1)
        block = lm.logits(prompt, 16)
        if not (np.isfinite(one.numpy()).all() and np.isfinite(block.numpy()).all()):
            raise SystemExit("the logits are not finite")
        lm.close()


if __name__ == "__main__":
    decode_check()
    sys.exit(0)
