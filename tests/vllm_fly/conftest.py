"""vLLM 0.34 FLy tests: run in ``.venv-vllm-fly`` (``scripts/setup.sh --vllm-fly``), by path::

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= .venv-vllm-fly/bin/python -m pytest tests/vllm_fly

They are not collected by the main suite (``norecursedirs``); an import error here is a
failure, never a skip. vLLM's Triton kernels run on CPU tensors under Triton's interpreter,
which needs both variables from the start: ``TRITON_INTERPRET=1`` before Triton is first
imported (torch and transformers import it before any conftest here could set it; Triton's own
``tl.max`` and friends are then compiled-only), and ``CUDA_VISIBLE_DEVICES=""`` before vLLM looks
for Triton's active driver (finding none, it would put a placeholder in Triton's place).
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    raise pytest.UsageError(
        "tests/vllm_fly runs vLLM's Triton kernels under Triton's interpreter: run it as "
        "TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= .venv-vllm-fly/bin/python -m pytest "
        "tests/vllm_fly"
    )

import vllm  # noqa: E402, F401  (fails loudly where vLLM is missing)
