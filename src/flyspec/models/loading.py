"""Loading causal LMs and tokenizers from a local folder, a GGUF file or the offline HF cache.

A model *spec* is one of:

- a local folder holding a Hugging Face checkpoint (``config.json`` + weights + tokenizer files);
- a path to a ``.gguf`` file (transformers dequantises it while loading; slow for big models, so
  convert once with :mod:`flyspec.models.default_pair` or ``save_pretrained``);
- a hub id such as ``Qwen/Qwen2.5-Coder-0.5B-Instruct``, resolved from the local Hugging Face
  cache only: flyspec never downloads from the hub.

Every user mistake (missing path, uncached hub id, mismatched tokenizers, unknown device) is raised
as :class:`flyspec.errors.FlyspecError` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from flyspec.errors import FlyspecError

# "name" or "owner/name": letters, digits, '-', '_', '.'; no leading dot, no '..'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")

_HOW_TO_PROVIDE = (
    "pass a local folder with config.json, a .gguf file, or a hub id already in the Hugging Face "
    "cache (e.g. fetched elsewhere with `hf download`); `flyspec models pull` installs the "
    "default pair"
)


@dataclass(frozen=True)
class _Source:
    """Where `from_pretrained` should look: a folder or hub id, maybe a GGUF file name."""

    location: str
    gguf_file: str | None
    local_files_only: bool
    display: str


def looks_like_hub_id(spec: str) -> bool:
    """True when `spec` has the shape of a Hugging Face hub id (``name`` or ``owner/name``)."""
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.lower().endswith(".gguf")


def _resolve_source(spec: str) -> _Source:
    if not isinstance(spec, str) or not spec.strip():
        raise FlyspecError(f"empty model spec; {_HOW_TO_PROVIDE}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; it holds {ggufs[0]}: pass that file instead" if ggufs else ""
            raise FlyspecError(f"not a model folder (no config.json): {path}{hint}")
        return _Source(str(path), None, True, str(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise FlyspecError(
                f"model path is a file but not a .gguf file: {path}; "
                "pass its folder or a .gguf file"
            )
        return _Source(str(path.parent), path.name, True, str(path))
    if looks_like_hub_id(spec):
        return _Source(spec, None, True, spec)
    raise FlyspecError(f"model path does not exist: {path}; {_HOW_TO_PROVIDE}")


def require_gguf_support() -> None:
    """FlyspecError, before the slow part, where transformers cannot read GGUF files: it needs
    the gguf and accelerate packages (the ``gguf`` extra)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise FlyspecError(
            f"reading a .gguf file needs the {' and '.join(missing)} package"
            f"{'s' if len(missing) > 1 else ''}: pip install 'flyspec[gguf]'"
        )


def _load_failed(source: _Source, what: str, error: Exception) -> FlyspecError:
    if Path(source.location).is_dir() or not isinstance(error, OSError):
        return FlyspecError(f"could not load the {what} from {source.display}: {_one_line(error)}")
    # transformers raises OSError for a hub id that is not in the local cache.
    return FlyspecError(
        f"model {source.display!r} was not found locally (not a folder, not in the Hugging Face "
        f"cache, and flyspec does not download); {_HOW_TO_PROVIDE}"
    )


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


BALANCED = "balanced"


def resolve_device(device: str | None) -> str:
    """Map ``None``/``"auto"`` to ``"cuda"`` when a GPU is usable, else ``"cpu"``; validate others.

    Accepted: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``, and ``balanced`` (the model's
    layers spread over every visible GPU, for targets too big for one). A device that is not
    available here raises FlyspecError.
    """
    if device is None or device.strip().lower() in ("", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    name = device.strip().lower()
    if name == "cpu":
        return "cpu"
    if name == BALANCED:
        if not torch.cuda.is_available():
            raise FlyspecError(
                f"device {BALANCED!r} spreads a model over the CUDA GPUs, but none is available"
            )
        return name
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match:
        if not torch.cuda.is_available():
            raise FlyspecError(
                f"device {device!r} asked for, but no CUDA GPU is available; use cpu"
            )
        if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
            raise FlyspecError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) here"
            )
        return name
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise FlyspecError("device 'mps' asked for, but MPS is not available here; use cpu")
        return name
    raise FlyspecError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N, mps or balanced")


DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The weights' dtype ``name`` (:data:`DTYPE_NAMES`) on ``device``. ``auto``: bfloat16 on
    CUDA, where a token's forward reads every weight once and half the bytes is close to half
    the time; float32 elsewhere, where flyspec's CPU kernels (oneDNN-packed float32 layers, an
    int8 draft) are float32 and bfloat16 is slow on CPUs without bfloat16 instructions."""
    if name == "auto":
        resolved = resolve_device(device)
        return (
            torch.bfloat16 if resolved == BALANCED or resolved.startswith("cuda") else torch.float32
        )
    if name not in DTYPE_NAMES:
        raise FlyspecError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, name)


def load_causal_lm(
    spec: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> transformers.PreTrainedModel:
    """Load a causal LM from a folder, a ``.gguf`` file or the offline HF cache, in eval mode."""
    source = _resolve_source(spec)
    target_device = resolve_device(device)
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": source.local_files_only}
    if target_device == BALANCED:
        kwargs["device_map"] = "auto"  # accelerate places the layers over all GPUs
    if source.gguf_file is not None:
        require_gguf_support()
        kwargs["gguf_file"] = source.gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except FlyspecError:
        raise
    except Exception as error:  # transformers, safetensors and gguf raise many kinds
        raise _load_failed(source, "model", error) from error
    if source.gguf_file is not None:
        release_gguf_quantizer(model)
    if target_device != BALANCED:
        model.to(target_device)
    model.eval()
    return model


def load_tokenizer(spec: str) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer belonging to a model spec (same resolution rules as `load_causal_lm`)."""
    source = _resolve_source(spec)
    kwargs: dict[str, Any] = {"local_files_only": source.local_files_only}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
    except FlyspecError:
        raise
    except Exception as error:  # transformers, tokenizers and gguf raise many kinds
        raise _load_failed(source, "tokenizer", error) from error
    if source.gguf_file is None and Path(source.location).is_dir():
        _check_tokenizer_files(Path(source.location), tokenizer)
    return tokenizer


def _check_tokenizer_files(folder: Path, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """Raise FlyspecError when ``folder`` holds none of the vocabulary files the tokenizer's
    class reads: transformers then builds an empty tokenizer (one token) from config.json
    alone, which would only surface later as a confusing vocabulary mismatch."""
    wanted = {
        name
        for key, name in getattr(type(tokenizer), "vocab_files_names", {}).items()
        if isinstance(name, str) and key != "tokenizer_config_file"
    }
    if not wanted or any((folder / name).is_file() for name in wanted):
        return
    present = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(present[:10]) + (", ..." if len(present) > 10 else "")
    raise FlyspecError(
        f"the model folder {folder} has no tokenizer: {', '.join(sorted(wanted))} "
        f"({type(tokenizer).__name__}'s files) are all missing; it holds {shown or 'nothing'}. "
        "Copy the tokenizer files from the model's source into the folder"
    )


def release_gguf_quantizer(model: transformers.PreTrainedModel) -> None:
    """Mark a model loaded from GGUF (and already dequantised to dense tensors) as a plain model.

    transformers 5.24 leaves a GGUF-loaded model marked as quantised even when it dequantised every
    weight (the legacy loader, used for qwen2/llama): ``model.hf_quantizer`` (a
    ``GgufHfQuantizer``), ``model.is_quantized``, ``model.quantization_method``,
    ``config.quantization_config`` and ``config._is_quantized``. ``save_pretrained`` then refuses
    ("quantized with gguf and is not serializable"), and ``.half()``/``.float()`` refuse too. This
    clears those attributes on *this* object only. A model whose weights stayed packed in GGUF
    blocks (the ``kernels`` fast path) is left alone, since it really is quantised.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if getattr(quantizer.quantization_config, "quant_method", None) != "gguf":
        return
    if getattr(quantizer, "packed_modules", None):
        return
    model.hf_quantizer = None
    model.is_quantized = False
    if "quantization_method" in vars(model):
        del model.quantization_method
    for config in {
        id(m.config): m.config for m in model.modules() if hasattr(m, "config")
    }.values():
        if "quantization_config" in vars(config):
            del config.quantization_config
        if "_is_quantized" in vars(config):
            del config._is_quantized


def check_same_tokenizer(
    draft_tokenizer: transformers.PreTrainedTokenizerBase,
    target_tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    draft_name: str,
    target_name: str,
) -> None:
    """Raise FlyspecError unless draft and target tokenizers share vocabulary and EOS token."""
    draft_vocab = draft_tokenizer.get_vocab()
    target_vocab = target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for tok, idx in draft_vocab.items() if target_vocab.get(tok) != idx)
        differing += sum(1 for tok in target_vocab if tok not in draft_vocab)
        raise FlyspecError(
            f"draft {draft_name!r} and target {target_name!r} use different tokenizers "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ); "
            "speculative decoding needs one vocabulary: pick a draft from the target's model family"
        )
    if draft_tokenizer.eos_token_id != target_tokenizer.eos_token_id:
        raise FlyspecError(
            f"draft {draft_name!r} and target {target_name!r} disagree on the end-of-sequence "
            "token "
            f"(id {draft_tokenizer.eos_token_id} vs {target_tokenizer.eos_token_id}); "
            "pick a draft from the target's model family"
        )
