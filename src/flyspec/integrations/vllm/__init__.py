"""FLy inside vLLM, as a general plugin (entry-point group ``vllm.general_plugins``).

vLLM loads the plugin in every process (front end, engine core, workers). It changes nothing
until it is switched on with a ``flyspec`` section in vLLM's ``additional_config``::

    vllm serve TARGET --speculative-config '{"method": "draft_model", "model": DRAFT,
        "num_speculative_tokens": 15}' --additional-config '{"flyspec": {}}'

(:mod:`flyspec.integrations.vllm.settings` lists the keys). Then the target's verification
runs flyspec's batched FLy rule (:func:`flyspec.decoding.verify.loosely_accepted`) on the
logits vLLM's sampler verifies with, before vLLM's own greedy and random rejection kernels
emit the tokens.
"""

from flyspec.integrations.vllm.settings import (
    ENV_VARIABLE,
    SECTION,
    TESTED_VLLM_VERSIONS,
    VllmPluginError,
    additional_config,
    parse_settings,
)

__all__ = [
    "ENV_VARIABLE",
    "SECTION",
    "TESTED_VLLM_VERSIONS",
    "VllmPluginError",
    "additional_config",
    "parse_settings",
]
