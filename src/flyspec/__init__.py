"""flyspec: training-free loosely speculative decoding (FLy) for Hugging Face causal LMs.

The public API is loaded lazily, so that ``import flyspec`` stays cheap and the command-line
entry point can configure the math libraries before torch is imported.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DecodeConfig": "flyspec.config",
    "FlyConfig": "flyspec.config",
    "KernelConfig": "flyspec.config",
    "SamplingConfig": "flyspec.config",
    "FlyspecError": "flyspec.errors",
    "Engine": "flyspec.engine",
    "GenerationResult": "flyspec.engine",
    "TextChunk": "flyspec.engine",
    "SpeculativeDecoder": "flyspec.decoding.loop",
    "TokenEvent": "flyspec.decoding.loop",
    "RequestStats": "flyspec.decoding.stats",
    "Verdict": "flyspec.decoding.verify",
    "verify_greedy": "flyspec.decoding.verify",
    "verify_sampling": "flyspec.decoding.verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flyspec' has no attribute {name!r}")
