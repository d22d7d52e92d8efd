"""Files written so that a reader never sees one half-written."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, flush it to disk and rename it into
    place (atomic on POSIX): an interrupted write leaves the old file or none, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(
        prefix=f".{path.stem[:8]}-", suffix=".tmp", dir=path.parent
    )
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
