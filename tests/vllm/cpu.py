"""Which CPUs the vLLM tests that start engines need."""

import pytest

from flyspec.support.machine import cpuinfo


def cpu_has_avx512() -> bool:
    """Whether the CPU reports AVX-512 (Linux; False where unknown)."""
    return "avx512f" in cpuinfo().get("flags", "").split()


needs_avx512 = pytest.mark.skipif(
    not cpu_has_avx512(),
    reason="starts vLLM engines, which need AVX-512 to finish in time: on a 2-core "
    "AVX2-only AMD EPYC (Zen 3) an engine test took 10-15 minutes (about one on AVX-512 CPUs), "
    "and the directory would outrun CI's 90 minutes; its kernel tests still run",
)
"""For the tests that start vLLM engines on the default pair."""
