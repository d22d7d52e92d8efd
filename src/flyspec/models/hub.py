"""The default pair from the Hugging Face hub: the official checkpoints, where the hub (or a
local copy in the hub's cache) is there.

A pull downloads the snapshot into the hub's own cache (``HF_HUB_CACHE``) and records which
snapshot it took in ``$FLYSPEC_HOME/models/<name>.hub.json``; loading then reads the snapshot
folder. Where the hub cannot be reached, ``huggingface_hub`` answers from its cache, and only
where neither has the files is the hub unavailable (:class:`HubUnavailable`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from flyspec.errors import FlyspecError, error_line

HUB_RECORD_SUFFIX = ".hub.json"
HUB_FILES = ("*.json", "*.safetensors", "merges.txt", "vocab.json", "tokenizer*")
"""What a pull takes from a repository: config, weights and tokenizer (no other formats)."""

Download = Callable[[str], str]
"""hub id -> local snapshot folder (``huggingface_hub.snapshot_download``, or a test's)."""


class HubUnavailable(FlyspecError):
    """Neither the hub nor its local cache has the model."""


def snapshot_download(hub_id: str) -> str:
    """The snapshot folder of ``hub_id``'s main revision: downloaded, or from the local cache
    where the hub cannot be reached."""
    import huggingface_hub

    return huggingface_hub.snapshot_download(hub_id, allow_patterns=list(HUB_FILES))


def fetch_snapshot(hub_id: str, download: Download | None = None) -> Path:
    """``download(hub_id)``; HubUnavailable, one line, where it fails."""
    try:
        return Path((download or snapshot_download)(hub_id))
    except (OSError, ValueError) as error:  # huggingface_hub's errors derive from these
        raise HubUnavailable(
            f"{hub_id} is neither reachable on the hub nor in its local cache ({error_line(error)})"
        ) from None


def check_snapshot(folder: Path, hub_id: str) -> None:
    """HubUnavailable unless ``folder`` holds a config, safetensors weights and a tokenizer."""
    missing = [
        what
        for what, patterns in (
            ("config.json", ("config.json",)),
            ("safetensors weights", ("*.safetensors",)),
            ("a tokenizer", ("tokenizer.json", "vocab.json")),
        )
        if not any(any(folder.glob(pattern)) for pattern in patterns)
    ]
    if missing:
        raise HubUnavailable(f"the snapshot of {hub_id} in {folder} lacks {', '.join(missing)}")


def pull_from_hub(hub_id: str, record: Path, *, download: Download | None = None) -> Path:
    """Fetch ``hub_id`` and write ``record`` naming its snapshot; return the snapshot folder."""
    folder = fetch_snapshot(hub_id, download)
    check_snapshot(folder, hub_id)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(record.name + ".partial")
    partial.write_text(
        json.dumps({"hub_id": hub_id, "revision": folder.name, "path": str(folder)}, indent=2)
        + "\n"
    )
    partial.replace(record)
    return folder


def recorded_snapshot(record: Path, hub_id: str) -> Path | None:
    """The snapshot folder ``record`` names, while it is still complete; None otherwise."""
    try:
        data = json.loads(record.read_text())
        folder = Path(data["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("hub_id") != hub_id:
        return None
    try:
        check_snapshot(folder, hub_id)
    except HubUnavailable:
        return None
    return folder
