"""llama.cpp's Python binding: whether it is installed, which, and whether it can decode on
this CPU, found out in a child process.

A binding built for a CPU feature that the machine announces but does not run (seen: AMX on a
2-core Xeon whose first tile instruction faulted) takes the whole process down inside
``llama_decode``, with no Python error to catch. So before the first llama.cpp model of a
process, a child process writes a tiny model of random weights, quantises it with the binding
to Q4_K_M (the default pair's quantisation: the kernels a real model runs, AMX's included) and
decodes one token, then 16. Its verdict is kept under ``$FLYSPEC_HOME/llamacpp-checks``, keyed
by the binding's build (its libraries' sizes and times) and the CPU, so the check runs once per
build and machine.

The child's work is :mod:`flyspec.models.llamacpp_probe`.
``python -m flyspec.models.llamacpp_binding`` prints the verdict (``--recheck``: a fresh one)
and exits 1 where the binding cannot decode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flyspec.errors import FlyspecError
from flyspec.support.home import flyspec_home
from flyspec.support.machine import cpu_identity

LLAMACPP_PACKAGE = "llama-cpp-python"
CHECK_SECONDS = 300
"""How long the child may take (a few seconds where all is well)."""
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def require_llamacpp():
    """The ``llama_cpp`` module, or a one-line FlyspecError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as error:
        raise FlyspecError(
            f"the llama.cpp backend needs {LLAMACPP_PACKAGE} ({error}): pip install "
            "'flyspec[llamacpp]' (it builds llama.cpp from source: cmake and a C++ compiler, "
            "about 20 minutes on 2 cores), or scripts/setup.sh --llamacpp"
        ) from None
    return llama_cpp


def llamacpp_version() -> str | None:
    """The installed binding's version (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(LLAMACPP_PACKAGE)
    except PackageNotFoundError:
        return None


def llamacpp_requirement() -> str:
    """The binding flyspec's ``llamacpp`` extra pins, e.g. ``llama-cpp-python==0.3.36``."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        pinned = requires("flyspec") or []
    except PackageNotFoundError:
        pinned = []
    for requirement in pinned:
        if requirement.startswith(LLAMACPP_PACKAGE):
            return requirement.split(";")[0].strip()
    return LLAMACPP_PACKAGE


def rebuild_command() -> str:
    """The command that rebuilds the binding for this CPU without AMX."""
    return (
        f"scripts/install_llamacpp.sh .venv in a flyspec checkout, or CFLAGS='{NO_AMX_FLAGS}' "
        f"CXXFLAGS='{NO_AMX_FLAGS}' pip install --force-reinstall --no-deps --no-cache-dir "
        f"'{llamacpp_requirement()}'"
    )


@dataclass(frozen=True)
class DecodeCheck:
    """The verdict: ``ok``, or what failed in ``detail``."""

    ok: bool
    detail: str
    binding: str
    cpu: str

    def describe(self) -> str:
        if self.ok:
            return f"llama.cpp's binding ({self.binding}) decodes on this CPU ({self.cpu})"
        return (
            f"llama.cpp's binding ({self.binding}) cannot decode on this CPU ({self.cpu}): "
            f"{self.detail}; rebuild it: {rebuild_command()}"
        )


def binding_build() -> tuple[str, str]:
    """The binding's version and a fingerprint of its build: its shared libraries' names,
    sizes and modification times."""
    package = Path(require_llamacpp().__file__).parent
    parts = [
        f"{lib.relative_to(package)}|{lib.stat().st_size}|{lib.stat().st_mtime_ns}"
        for lib in sorted(package.rglob("*.so*")) + sorted(package.rglob("*.dylib"))
    ]
    return str(llamacpp_version()), hashlib.sha256("\n".join(parts).encode()).hexdigest()


def verdict_path(home: Path | None = None) -> Path:
    """Where the verdict for this binding build and CPU is kept."""
    version, build = binding_build()
    name, flags = cpu_identity()
    key = hashlib.sha256(f"{version}|{build}|{name}|{flags}".encode()).hexdigest()[:16]
    return flyspec_home(home) / "llamacpp-checks" / f"{key}.json"


def check_decoding(*, recheck: bool = False, home: Path | None = None) -> DecodeCheck:
    """The verdict for the installed binding on this CPU: kept from an earlier check, else
    found now in a child process (``recheck``: always found now)."""
    path = verdict_path(home)
    if not recheck and path.is_file():
        try:
            return DecodeCheck(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a damaged record: check again
    verdict = _run_child()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(verdict)))
    partial.replace(path)
    return verdict


def ensure_llamacpp_decodes(home: Path | None = None) -> None:
    """Raise a one-line FlyspecError where the binding cannot decode on this CPU."""
    verdict = check_decoding(home=home)
    if not verdict.ok:
        raise FlyspecError(verdict.describe())


def _run_child() -> DecodeCheck:
    name, _ = cpu_identity()
    binding = f"llama-cpp-python {llamacpp_version()}"
    command = [sys.executable, "-m", "flyspec.models.llamacpp_probe"]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        return DecodeCheck(False, f"the check did not end in {CHECK_SECONDS} s", binding, name)
    if child.returncode == 0:
        return DecodeCheck(True, "", binding, name)
    if child.returncode < 0:
        signal_name = signal.Signals(-child.returncode).name
        detail = f"a test decode was killed by {signal_name}"
    else:
        lines = [line for line in child.stderr.splitlines() if line.strip()]
        detail = f"a test decode failed: {lines[-1] if lines else f'exit {child.returncode}'}"
    return DecodeCheck(False, detail, binding, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flyspec.models.llamacpp_binding",
        description="Check that llama.cpp's binding decodes on this CPU.",
    )
    parser.add_argument("--recheck", action="store_true", help="check anew, not from the record")
    args = parser.parse_args(argv)
    try:
        verdict = check_decoding(recheck=args.recheck)
    except FlyspecError as error:
        print(f"flyspec: {error}", file=sys.stderr)
        return 1
    print(verdict.describe(), file=sys.stdout if verdict.ok else sys.stderr)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
