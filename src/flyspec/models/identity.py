"""What identifies a model's weights, cheaply: the key of caches and of calibrations."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

_HASHED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "flyspec-ok.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@lru_cache(maxsize=16)
def model_identity(spec: str) -> dict:
    """What identifies a model's weights, cheaply: the resolved path, the size of every
    weight file and the SHA-256 of the small files that describe it. A hub id that is not a
    local path is identified by its name."""
    path = Path(spec).expanduser()
    if not path.exists():
        return {"name": spec}
    real = path.resolve()
    files = [real] if real.is_file() else sorted(p for p in real.iterdir() if p.is_file())
    sizes = {p.name: p.stat().st_size for p in files if p.suffix in _WEIGHT_SUFFIXES}
    hashes = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.name in _HASHED_FILES
    }
    return {"path": str(real), "weights": sizes, "files": hashes}
