"""On-disk cache of generations, so an interrupted evaluation resumes and a rerun is free.

One small JSON file per generation, ``<cache dir>/<key[:2]>/<key>.json``, written to a
temporary file in the same folder and renamed into place (atomic on POSIX). The key is the
SHA-256 of everything that decides the generated text:

* the models' identities (:func:`flyspec.models.identity.model_identity`: the resolved path,
  the sizes of the weight files, hashes of the small config/tokenizer files and of flyspec's
  install marker); the draft model only where the method uses it;
* the weights' dtype and device;
* the prompt's token ids, the task's prompt/stop-rule version, and the prediction's token ids
  where the request has one (Predicted Outputs) and drafts;
* the decoding settings that can change the text (:func:`flyspec.decoding.loop.text_settings`),
  without the token budget: an entry made under another ``max_new_tokens`` is reused when
  :func:`reusable` shows the budget cannot have changed its text (a greedy generation that
  ended well before both budgets);
* the decoder's revision (:data:`flyspec.decoding.loop.DECODER_REVISION`), bumped with every change
  to what the decoder emits, so that no entry outlives the code that made it.

A cached entry keeps the timing statistics of the run that produced it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import DECODER_REVISION, budget_margin, text_settings
from flyspec.support.atomic_files import write_text_atomically

CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    from flyspec.support.home import flyspec_home

    return flyspec_home() / "eval-cache"


def decoding_identity(config: DecodeConfig) -> dict:
    """The decoding settings that can change the generated text, with the decoder's revision."""
    return {"decoder_revision": DECODER_REVISION, **text_settings(config)}


def reusable(entry: dict, config: DecodeConfig) -> bool:
    """Whether a cached generation made under ``entry["max_new_tokens"]`` is exactly what
    ``config`` would generate: always under the same budget; otherwise only for greedy
    decoding, when the entry ended (EOS, stop string, answer) rather than hit its budget, far
    enough before both budgets (:func:`~flyspec.decoding.loop.budget_margin`)."""
    old_budget = entry.get("max_new_tokens")
    if old_budget == config.max_new_tokens:
        return True
    if not isinstance(old_budget, int) or not config.sampling.greedy:
        return False
    if entry.get("finish_reason") in (None, "length"):
        return False
    emitted = len(entry.get("token_ids", ()))
    return emitted + budget_margin(config) < min(old_budget, config.max_new_tokens)


def generation_key(
    *,
    task_version: str,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    target: dict,
    draft: dict | None,
    dtype: str,
    device: str,
    kernels: dict | None = None,
    prediction_ids: Sequence[int] | None = None,
) -> str:
    """The cache key of one generation. ``kernels`` (``Engine.kernels``: Linear kernels,
    quantisation, forward paths) is part of it because those change rounding and so, in
    near-ties, the text; the draft's entries count only where a draft model is used. A
    prediction (Predicted Outputs) counts where something is drafted from it."""
    kernels = dict(kernels or {})
    if not config.uses_draft_model:
        kernels = {name: value for name, value in kernels.items() if not name.startswith("draft")}
    payload = {
        "format": CACHE_FORMAT,
        "task": task_version,
        "target": target,
        "draft": draft if config.uses_draft_model else None,
        "dtype": dtype,
        "device": device,
        "kernels": kernels,
        "prompt_ids": list(prompt_ids),
        "decoding": decoding_identity(config),
    }
    if prediction_ids is not None and config.mode != "target":
        payload["prediction_ids"] = list(prediction_ids)
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class GenerationCache:
    """JSON entries under ``folder``; ``folder=None`` caches nothing."""

    def __init__(self, folder: Path | str | None) -> None:
        self.folder = None if folder is None else Path(folder).expanduser()
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str, config: DecodeConfig | None = None) -> dict | None:
        """The entry under ``key`` (usable for ``config`` when given, see :func:`reusable`)."""
        if self.folder is None:
            self.misses += 1
            return None
        try:
            entry = json.loads(self._path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            entry = None
        if (
            not isinstance(entry, dict)
            or entry.get("key") != key
            or (config is not None and not reusable(entry, config))
        ):
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def put(self, key: str, entry: dict) -> None:
        if self.folder is None:
            return
        text = json.dumps({**entry, "key": key}, ensure_ascii=False)
        write_text_atomically(self._path(key), text)
