"""``register()``: the entry point vLLM calls in each of its processes."""

from __future__ import annotations

import importlib
import logging
import sys

from flyspec.integrations.vllm.launch import native_fly_version
from flyspec.integrations.vllm.metrics import choose_stats_dir, register_collector
from flyspec.integrations.vllm.sampler import fly_sampler_class, refusing_sampler_class
from flyspec.integrations.vllm.settings import VllmPluginError, settings_in_force

logger = logging.getLogger("vllm.flyspec")  # under vLLM's own log handler and level

V1_SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"
V1_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner",)
V2_SAMPLER_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
V2_RUNNER_MODULES = ("vllm.v1.worker.gpu.model_runner",)


def _install(class_module: str, runner_modules: tuple[str, ...], make_class) -> bool:
    """Put ``make_class(original)`` where vLLM's model runners look up ``RejectionSampler``:
    its defining module, and the runner modules already imported (which bound the name at
    import). Idempotent; False where this vLLM has no such module."""
    try:
        module = importlib.import_module(class_module)
    except ImportError:
        return False
    original = getattr(module, "RejectionSampler", None)
    if original is None:
        return False
    base = getattr(original, "flyspec_base", original)
    replacement = original if original is not base else make_class(base)
    module.RejectionSampler = replacement
    for name in runner_modules:
        runner = sys.modules.get(name)
        if runner is not None and getattr(runner, "RejectionSampler", None) is base:
            runner.RejectionSampler = replacement
    return True


def register() -> None:
    """Make vLLM's rejection samplers FLy-aware. Nothing changes until an engine's
    ``additional_config`` has a ``flyspec`` section (or ``FLYSPEC_VLLM`` is set): the samplers
    read it when the engine builds them and fail the start-up on a bad value."""
    fly_from_environment = settings_in_force(None)  # a bad FLYSPEC_VLLM fails here
    if not _install(V1_SAMPLER_MODULE, V1_RUNNER_MODULES, fly_sampler_class):
        version = native_fly_version()
        if version is not None:
            # vLLM's own FLy runs; V2RejectionSampler names its keys to a `flyspec` section.
            logger.info("vLLM %s has FLy built in: flyspec's FLy plugin stays out of it", version)
        else:
            message = (
                f"flyspec's FLy plugin found no {V1_SAMPLER_MODULE}.RejectionSampler in this "
                "vLLM: FLy cannot run in it"
            )
            if fly_from_environment is not None:
                raise VllmPluginError(message)
            logger.warning(message)
    _install(V2_SAMPLER_MODULE, V2_RUNNER_MODULES, refusing_sampler_class)
    register_collector(choose_stats_dir())
