"""The plugin's settings, read from vLLM's ``additional_config`` (no vLLM import here, so the
CLI can validate them before it starts an engine).

Keys of the ``flyspec`` section, named as in vLLM's open FLy pull request so that moving to an
upstream FLy is a matter of moving the keys into ``speculative_config``:

* ``rejection_sample_method``: ``"fly"`` (the default once the section is present) or
  ``"standard"`` (vLLM's exact verification, the plugin off).
* ``fly_window_size``: W, the exact matches required after a loosely accepted mismatch
  (default 6; flyspec's convention, see :mod:`flyspec.config`).
* ``fly_entropy_threshold``: theta of the entropy gate (default 0.3).
* ``fly_entropy``: ``"top3"`` (default) or ``"normalized"``.

Where ``additional_config`` has no ``flyspec`` section, the environment variable
``FLYSPEC_VLLM`` may hold the same section as JSON (a fallback for launchers that cannot pass
``additional_config``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from flyspec.config import DEFAULT_THETA, DEFAULT_WINDOW, ConfigError, FlyConfig
from flyspec.errors import FlyspecError

SECTION = "flyspec"
ENV_VARIABLE = "FLYSPEC_VLLM"
METHODS = ("fly", "standard")
KEYS = (
    "rejection_sample_method",
    "fly_window_size",
    "fly_entropy_threshold",
    "fly_entropy",
    "fly_min_ratio",
    "fly_max_rank",
)
"""The first four are the names of vLLM's open FLy pull request; the plausibility floor's two
are flyspec's own. Deferral across blocks holds tokens back between engine steps, which vLLM's
scheduler does not allow: it is not offered here."""
TESTED_VLLM_VERSIONS = ("0.32.0",)
"""vLLM releases whose verification seam the plugin is tested on (the CPU build here)."""


class VllmPluginError(FlyspecError, ValueError):
    """The plugin cannot run as configured: a bad setting or a vLLM without the seam."""


def parse_settings(section: Any) -> FlyConfig | None:
    """The FLy rule a ``flyspec`` section asks for, or None for exact verification.

    Raises :class:`VllmPluginError` with a one-line message for an unknown key or a bad value.
    """
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise VllmPluginError(
            f"additional_config['{SECTION}'] must be an object, got {type(section).__name__}"
        )
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise VllmPluginError(
            f"unknown key(s) in additional_config['{SECTION}']: {', '.join(unknown)} "
            f"(known: {', '.join(KEYS)})"
        )
    method = section.get("rejection_sample_method", "fly")
    if method not in METHODS:
        raise VllmPluginError(
            f"rejection_sample_method must be one of {', '.join(METHODS)}, got {method!r}"
        )
    window = section.get("fly_window_size", DEFAULT_WINDOW)
    theta = section.get("fly_entropy_threshold", DEFAULT_THETA)
    if isinstance(window, bool) or isinstance(theta, bool):
        raise VllmPluginError("fly_window_size and fly_entropy_threshold must be numbers")
    try:
        fly = FlyConfig(
            window=window,
            theta=theta,
            entropy=section.get("fly_entropy", "top3"),
            min_ratio=section.get("fly_min_ratio", 0.0),
            max_rank=section.get("fly_max_rank", 0),
        )
    except ConfigError as error:
        raise VllmPluginError(f"bad additional_config['{SECTION}']: {error}") from None
    if method == "standard" or math.isinf(fly.theta):
        return None
    return fly


def section_from(additional: Mapping[str, Any] | None, environ: Mapping[str, str]) -> Any:
    """The ``flyspec`` section of vLLM's ``additional_config``, else the JSON of the
    ``FLYSPEC_VLLM`` environment variable, else None."""
    if additional and SECTION in additional:
        return additional[SECTION]
    text = environ.get(ENV_VARIABLE, "").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise VllmPluginError(f"{ENV_VARIABLE} is not valid JSON: {error}") from None


def settings_in_force(additional: Mapping[str, Any] | None) -> FlyConfig | None:
    """The rule a vLLM engine with this ``additional_config`` runs (environment fallback)."""
    return parse_settings(section_from(additional, os.environ))


NATIVE_ENTROPY_TOP_K = 3
"""vLLM's ``fly_entropy_top_k`` for flyspec's default gate (the top-3 entropy)."""


def native_speculative_keys(fly: FlyConfig | None, *, vllm_version: str) -> dict[str, Any]:
    """The ``speculative_config`` keys that run ``fly`` on a vLLM with FLy built in (0.34 and
    later), or exact verification for None. Both count the window alike: W native acceptances
    after the mismatch, inside the block.

    Raises :class:`VllmPluginError` with one line naming the option for a setting that vLLM's
    FLy has no equivalent of."""
    if fly is None or math.isinf(fly.theta):
        return {"rejection_sample_method": "standard"}
    unmapped = [
        (fly.entropy != "top3", "--entropy normalized (the full-vocabulary entropy)"),
        (fly.min_ratio > 0, "--min-ratio (the plausibility floor)"),
        (fly.max_rank > 0, "--max-rank (the plausibility floor)"),
        (fly.defer, "--defer (deferral across blocks)"),
        (fly.max_draft_confidence < 1, "--max-draft-confidence (the draft's doubt)"),
        (fly.window < 1, "--window 0 (vLLM's fly_window_size is at least 1)"),
    ]
    for given, option in unmapped:
        if given:
            raise VllmPluginError(
                f"{option} has no equivalent in the FLy built into vLLM {vllm_version}: leave "
                "it out (a pair's calibrated rule may set it: --no-calibration), or use "
                "flyspec's own engine"
            )
    return {
        "rejection_sample_method": "fly",
        "fly_window_size": fly.window,
        "fly_entropy_threshold": fly.theta,
        "fly_entropy_top_k": NATIVE_ENTROPY_TOP_K,
    }


def section_refused_by_native_fly(section: Any, *, vllm_version: str) -> VllmPluginError:
    """The start-up error for a ``flyspec`` section on a vLLM with FLy built in: one line
    with the ``speculative_config`` keys to use instead."""
    try:
        keys = json.dumps(
            native_speculative_keys(parse_settings(section), vllm_version=vllm_version)
        )
    except VllmPluginError as error:
        return error
    return VllmPluginError(
        f"vLLM {vllm_version} has FLy built in and flyspec's plugin stays out of it: remove "
        f"additional_config['{SECTION}'] (or {ENV_VARIABLE}) and add {keys} to "
        "speculative_config"
    )


def additional_config(fly: FlyConfig | None) -> dict[str, Any]:
    """vLLM's ``additional_config`` that switches the plugin on with ``fly`` (or leaves
    verification exact for None)."""
    if fly is None or math.isinf(fly.theta):
        return {SECTION: {"rejection_sample_method": "standard"}}
    if fly.defer:
        raise VllmPluginError(
            "deferral across blocks (--defer, which a pair's calibrated rule may set) is not "
            "available inside vLLM: give --no-defer, or use flyspec's own engine"
        )
    if fly.max_draft_confidence < 1:
        raise VllmPluginError(
            "the draft's doubt (--max-draft-confidence, which a pair's calibrated rule may set) "
            "is not available inside vLLM, whose proposers do not pass the draft model's "
            "probabilities of greedy tokens: give --max-draft-confidence 1, or use flyspec's "
            "own engine"
        )
    section = {
        "rejection_sample_method": "fly",
        "fly_window_size": fly.window,
        "fly_entropy_threshold": fly.theta,
        "fly_entropy": fly.entropy,
    }
    if fly.min_ratio > 0:
        section["fly_min_ratio"] = fly.min_ratio
    if fly.max_rank > 0:
        section["fly_max_rank"] = fly.max_rank
    return {SECTION: section}
