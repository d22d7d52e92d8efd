"""Process-level settings for fast CPU inference, applied by the command-line entry points.

They must be in place before torch loads its math libraries, so the CLI calls
:func:`configure_cpu_math` before it imports torch. Library users set them themselves.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_has_avx2() -> bool:
    """True on an x86 CPU that reports AVX2 (Linux only; False where unknown)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def configure_cpu_math() -> None:
    """Pin MKL to its AVX2 code path on AVX2 CPUs unless the user chose one.

    On AVX2-only CPUs MKL's automatic code path made a 16-token forward of the 1.5B target cost
    much more relative to a 1-token forward than the AVX2 path; with the default oneDNN-packed
    Linear layers (:mod:`flyspec.models.kernels`) MKL no longer runs them at all. Kept because
    it never measured slower than unset.
    """
    if "MKL_CBWR" not in os.environ and cpu_has_avx2():
        os.environ["MKL_CBWR"] = "AVX2"


def set_torch_threads(threads: int) -> None:
    """Use ``threads`` threads for torch's intra-op parallelism (matrix products)."""
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
