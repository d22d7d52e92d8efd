"""flyspec's cache folder: the models it installs, its datasets, its evaluation cache."""

from __future__ import annotations

import os
from pathlib import Path


def flyspec_home(home: Path | None = None) -> Path:
    """The cache folder: `home` if given, else ``$FLYSPEC_HOME``, else ``~/.cache/flyspec``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("FLYSPEC_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "flyspec"
