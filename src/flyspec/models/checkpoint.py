"""What a safetensors checkpoint holds, read from its headers alone (nothing else of the file
is read)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path


def safetensors_header(handle) -> tuple[dict, int]:
    """The header of the safetensors file open as ``handle`` (every tensor's dtype, shape and
    byte range, ``__metadata__`` left out) and the offset where the tensors' bytes begin."""
    (size,) = struct.unpack("<Q", handle.read(8))
    header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (none for anything else)."""
    folder = Path(folder)
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def checkpoint_parameters(folder: Path) -> int | None:
    """The number of parameters in the safetensors files of ``folder``, from their headers
    (nothing else is read), or None where there are none."""
    files = checkpoint_files(folder)
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as handle:
            header, _ = safetensors_header(handle)
        total += sum(math.prod(entry["shape"]) for entry in header.values())
    return total
