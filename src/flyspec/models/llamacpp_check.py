"""Whether the installed llama.cpp binding can decode on this CPU, found out in a child process.

A binding built for a CPU feature that the machine announces but does not run (seen: AMX on a
2-core Xeon whose first tile instruction faulted) takes the whole process down inside
``llama_decode``, with no Python error to catch. So before the first llama.cpp model of a
process, a child process writes a tiny model of random weights, quantises it with the binding
to Q4_K_M (the default pair's quantisation: the kernels a real model runs, AMX's included) and
decodes one token, then 16. Its verdict is kept under ``$FLYSPEC_HOME/llamacpp-checks``, keyed
by the binding's build (its libraries' sizes and times) and the CPU, so the check runs once per
build and machine.

``python -m flyspec.models.llamacpp_check`` prints the verdict (``--recheck``: a fresh one)
and exits 1 where the binding cannot decode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from flyspec.errors import FlyspecError
from flyspec.models.home import flyspec_home

CHECK_SECONDS = 300
"""How long the child may take (a few seconds where all is well)."""
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

_HIDDEN, _FFN, _HEADS, _KV_HEADS, _VOCAB = 256, 512, 4, 2, 300
"""The tiny model: rows of 256 (a K-quant's block) so that every weight is quantised."""
_LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def rebuild_command() -> str:
    """The command that rebuilds the binding for this CPU without AMX."""
    from flyspec.models.llamacpp import llamacpp_requirement

    return (
        f"scripts/install_llamacpp.sh .venv in a flyspec checkout, or CFLAGS='{NO_AMX_FLAGS}' "
        f"CXXFLAGS='{NO_AMX_FLAGS}' pip install --force-reinstall --no-deps --no-cache-dir "
        f"'{llamacpp_requirement()}'"
    )


@dataclass(frozen=True)
class DecodeCheck:
    """The verdict: ``ok``, or what failed in ``detail``."""

    ok: bool
    detail: str
    binding: str
    cpu: str

    def describe(self) -> str:
        if self.ok:
            return f"llama.cpp's binding ({self.binding}) decodes on this CPU ({self.cpu})"
        return (
            f"llama.cpp's binding ({self.binding}) cannot decode on this CPU ({self.cpu}): "
            f"{self.detail}; rebuild it: {rebuild_command()}"
        )


def cpu_identity() -> tuple[str, str]:
    """The CPU's model name and its feature flags (what a native build depends on)."""
    name, flags = platform.machine(), ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == platform.machine():
            name = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = value.strip()
    return name, flags


def binding_build() -> tuple[str, str]:
    """The binding's version and a fingerprint of its build: its shared libraries' names,
    sizes and modification times."""
    from flyspec.models.llamacpp import llamacpp_version, require_llamacpp

    package = Path(require_llamacpp().__file__).parent
    parts = [
        f"{lib.relative_to(package)}|{lib.stat().st_size}|{lib.stat().st_mtime_ns}"
        for lib in sorted(package.rglob("*.so*")) + sorted(package.rglob("*.dylib"))
    ]
    return str(llamacpp_version()), hashlib.sha256("\n".join(parts).encode()).hexdigest()


def verdict_path(home: Path | None = None) -> Path:
    """Where the verdict for this binding build and CPU is kept."""
    version, build = binding_build()
    name, flags = cpu_identity()
    key = hashlib.sha256(f"{version}|{build}|{name}|{flags}".encode()).hexdigest()[:16]
    return flyspec_home(home) / "llamacpp-checks" / f"{key}.json"


def check_decoding(*, recheck: bool = False, home: Path | None = None) -> DecodeCheck:
    """The verdict for the installed binding on this CPU: kept from an earlier check, else
    found now in a child process (``recheck``: always found now)."""
    path = verdict_path(home)
    if not recheck and path.is_file():
        try:
            return DecodeCheck(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a damaged record: check again
    verdict = _run_child()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(verdict)))
    partial.replace(path)
    return verdict


def ensure_llamacpp_decodes(home: Path | None = None) -> None:
    """Raise a one-line FlyspecError where the binding cannot decode on this CPU."""
    verdict = check_decoding(home=home)
    if not verdict.ok:
        raise FlyspecError(verdict.describe())


def _run_child() -> DecodeCheck:
    from flyspec.models.llamacpp import llamacpp_version

    name, _ = cpu_identity()
    binding = f"llama-cpp-python {llamacpp_version()}"
    command = [sys.executable, "-m", "flyspec.models.llamacpp_check", "--child"]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        return DecodeCheck(False, f"the check did not end in {CHECK_SECONDS} s", binding, name)
    if child.returncode == 0:
        return DecodeCheck(True, "", binding, name)
    if child.returncode < 0:
        signal_name = signal.Signals(-child.returncode).name
        detail = f"a test decode was killed by {signal_name}"
    else:
        lines = [line for line in child.stderr.splitlines() if line.strip()]
        detail = f"a test decode failed: {lines[-1] if lines else f'exit {child.returncode}'}"
    return DecodeCheck(False, detail, binding, name)


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


def _child() -> None:
    """Quantise a tiny model with the binding, decode 1 then 16 tokens, check the logits."""
    import numpy as np

    from flyspec.models.llamacpp import LlamaCppLM, require_llamacpp

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flyspec.models.llamacpp_check",
        description="Check that llama.cpp's binding decodes on this CPU.",
    )
    parser.add_argument("--recheck", action="store_true", help="check anew, not from the record")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
        return 0
    try:
        verdict = check_decoding(recheck=args.recheck)
    except FlyspecError as error:
        print(f"flyspec: {error}", file=sys.stderr)
        return 1
    print(verdict.describe(), file=sys.stdout if verdict.ok else sys.stderr)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
