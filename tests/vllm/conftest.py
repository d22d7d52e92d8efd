"""vLLM tests: run in the environment that has vLLM (``.venv-vllm``, see scripts/setup.sh).

They are not collected by the main suite (``testpaths``); an import error here is a failure,
never a skip.
"""

import pytest
import vllm  # noqa: F401  (fails loudly where vLLM is missing)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels():
    """vLLM's CPU C++ kernels in place of its Triton ones, as a CPU worker installs them."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
