"""Option groups shared by the ``flyspec`` commands, and what they turn into: the decoding
settings (:class:`~flyspec.config.DecodeConfig`), the kernel policy
(:class:`~flyspec.config.KernelConfig`), a loaded :class:`~flyspec.engine.Engine`, a vLLM
engine spec.

Only argparse and the config module are imported here, so that ``flyspec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Collection, Mapping, Sequence

from flyspec import config as cfg
from flyspec.errors import FlyspecError
from flyspec.support.console import say

EXIT_USAGE = 2
DTYPES = ("float32", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"flyspec: error: {message} (see {self.prog} --help)\n")


def number(text: str) -> float:
    """argparse type: a float that also reads 'inf' (theta = inf switches loosening off)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def block_size(text: str) -> int | str:
    """argparse type of -k: an integer, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or auto: {text!r}") from None


def add_option(container, *flags: str, aliases: Sequence[str] = (), **settings) -> argparse.Action:
    """Add an option to ``container`` (a parser or an argument group) under ``flags``, and its
    former names ``aliases`` hidden from help: they write the same destination, so command
    lines written with them keep working."""
    action = container.add_argument(*flags, **settings)
    if aliases:
        shared = {
            key: value
            for key, value in settings.items()
            if key not in ("default", "dest", "help", "metavar")
        }
        container.add_argument(
            *aliases, **shared, dest=action.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return action


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The model group (--model, --draft-model) of every command that loads models; returns
    it, for a command's own model options."""
    group = parser.add_argument_group("model")
    add_option(
        group,
        "--model",
        aliases=("--target",),
        dest="target",
        metavar="MODEL",
        help="target model: folder, .gguf file or cached hub id (default: the embedded pair's)",
    )
    add_option(
        group,
        "--draft-model",
        aliases=("--draft",),
        dest="draft",
        metavar="MODEL",
        help="draft model: folder, .gguf file or cached hub id (default: the embedded pair's)",
    )
    return group


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs the forwards (--backend, --device, --dtype, --threads, ...) and the CPU
    kernels, shared by every command that loads models."""
    group = parser.add_argument_group("backend (what runs the forwards)")
    group.add_argument(
        "--backend",
        default="torch",
        choices=cfg.BACKENDS,
        help="torch (default; any Hugging Face model, any device) or llamacpp (GGUF files on "
        "the CPU through llama-cpp-python: --model/--draft-model name .gguf files, by default "
        "the pair's from `flyspec models pull --gguf`)",
    )
    group.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="weight dtype (default auto: bfloat16 on CUDA, float32 elsewhere)",
    )
    add_option(
        group,
        "--threads",
        aliases=("--llamacpp-threads",),
        metavar="N",
        type=int,
        default=0,
        help="threads of the forwards, torch's or llama.cpp's (default 0: torch's choice, or "
        "every core this process may use on llama.cpp)",
    )
    group.add_argument(
        "--llamacpp-context",
        type=int,
        default=cfg.LlamaCppConfig().context,
        help="tokens of context llama.cpp allocates (default 8192)",
    )
    defaults = cfg.KernelConfig()
    kernels = parser.add_argument_group("CPU kernels (applied to the models after loading)")
    kernels.add_argument(
        "--linear",
        default=defaults.linear,
        choices=cfg.LINEAR_KERNELS,
        help="float32 Linear layers on oneDNN with pre-packed weights (default), or torch's "
        "default kernels",
    )
    kernels.add_argument(
        "--draft-quant",
        default=defaults.draft_quant,
        choices=cfg.QUANTIZATIONS,
        help="int8 (dynamic) or fp16 weights for the draft's Linear layers (default int8; a "
        "draft never changes what exact SPD emits)",
    )
    kernels.add_argument(
        "--target-quant",
        default=defaults.target_quant,
        choices=cfg.QUANTIZATIONS,
        help="int8 or fp16 weights for the target's Linear layers (default none; int8 makes a "
        "multi-token forward differ from one-token forwards, so spd no longer equals target)",
    )
    kernels.add_argument(
        "--forward",
        default=defaults.forward,
        choices=cfg.FORWARD_PATHS,
        help="auto (default): compiled on CUDA, lean elsewhere; lean: flyspec's own forward "
        "with a preallocated KV cache for Llama-family models (other models fall back to "
        "transformers'); compiled: the same through torch.compile, CUDA graphs on a GPU "
        "(compiled on first use, checked against the eager forward; on the CPU only with "
        "--linear default --draft-quant none); or transformers' model(...)",
    )


def forward_threads(args: argparse.Namespace) -> int:
    """--threads, checked (FlyspecError): 0 leaves the choice to the backend."""
    if args.threads < 0:
        raise FlyspecError(f"--threads must be >= 0 (0: the backend's choice), got {args.threads}")
    return args.threads


def add_chat_argument(
    container, *, default: bool | None, help: str, prompt_style_alias: bool = False
) -> None:
    """--chat/--no-chat: whether prompts go through the tokenizer's chat template (None: when
    it has one). ``prompt_style_alias``: also the former --prompt-style auto|chat|raw."""
    container.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=default, help=help
    )
    if prompt_style_alias:
        container.add_argument(
            "--prompt-style",
            type=prompt_style,
            dest="chat",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


PROMPT_STYLE_CHAT = {"auto": None, "chat": True, "raw": False}
"""The former --prompt-style's values, as --chat/--no-chat's."""


def prompt_style(text: str) -> bool | None:
    """argparse type of the former --prompt-style: what --chat/--no-chat would set."""
    try:
        return PROMPT_STYLE_CHAT[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"choose from {', '.join(PROMPT_STYLE_CHAT)}, got {text!r}"
        ) from None


def kernel_config_from_args(args: argparse.Namespace) -> cfg.KernelConfig:
    return cfg.KernelConfig(
        linear=args.linear,
        draft_quant=args.draft_quant,
        target_quant=args.target_quant,
        forward=args.forward,
    )


def dtype_name(args: argparse.Namespace) -> str:
    """The weights' dtype --dtype names on --device (``auto`` resolved), as reports give it."""
    from flyspec.models.loading import resolve_dtype

    return str(resolve_dtype(args.dtype, args.device)).removeprefix("torch.")


def load_engine(args: argparse.Namespace, *, with_draft: bool, backend: str | None = None):
    """Load the model pair named by --model/--draft-model on ``backend`` (None: --backend)
    with the chosen kernels and threads (:func:`flyspec.models.pair.load_pair`), reporting
    progress on stderr."""
    from flyspec.engine import Engine
    from flyspec.models.pair import load_pair

    backend = backend or args.backend
    started = time.perf_counter()
    say(f"loading models{' (target only)' if not with_draft else ''} ...")
    settings = _llamacpp_settings(args) if backend == "llamacpp" else _torch_settings(args)
    engine = Engine.from_pair(
        load_pair(
            target=args.target,
            draft=args.draft,
            with_draft=with_draft,
            backend=backend,
            **settings,
        )
    )
    kernels = engine.kernels
    seconds = time.perf_counter() - started
    if backend == "llamacpp":
        say(
            f"loaded on llama.cpp {kernels['llamacpp']} in {seconds:.1f}s "
            f"(threads: {kernels['threads']}, target: {kernels['weights']})"
        )
        return engine
    import torch

    chosen = str(settings["dtype"]).removeprefix("torch.")
    chosen += " (auto)" if args.dtype == "auto" else ""
    say(
        f"loaded in {seconds:.1f}s (dtype: {chosen}, "
        f"threads: {torch.get_num_threads()}, "
        f"linear: {kernels['linear']}, draft: {kernels['draft_quant']}, "
        f"target: {kernels['target_quant']}, forward: {kernels['forward']})"
    )
    return engine


def _torch_settings(args: argparse.Namespace) -> dict:
    """:func:`~flyspec.models.pair.load_pair`'s torch settings from --device, --dtype and the
    kernel options; --threads set for torch here (it holds for the whole process)."""
    from flyspec.models.loading import resolve_dtype
    from flyspec.support.cpu_math import set_torch_threads

    if forward_threads(args):
        set_torch_threads(args.threads)
    return {
        "device": args.device,
        "dtype": resolve_dtype(args.dtype, args.device),
        "kernels": kernel_config_from_args(args),
    }


def _llamacpp_settings(args: argparse.Namespace) -> dict:
    """:func:`~flyspec.models.pair.load_pair`'s llama.cpp settings from --threads and
    --llamacpp-context; FlyspecError where --device or --dtype asks for what llama.cpp does
    not do."""
    if args.device not in ("cpu", "auto") or args.dtype not in ("auto", "float32"):
        raise FlyspecError(
            "--backend llamacpp runs the GGUF files' own weights on the CPU: drop --device and "
            "--dtype"
        )
    context = args.llamacpp_context
    return {"llamacpp": cfg.LlamaCppConfig(context=context, threads=forward_threads(args))}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--engine and the settings of a vLLM engine (``--engine vllm``; the FLy plugin), in a
    group of their own, returned for a command's own vLLM options."""
    group = parser.add_argument_group("vLLM engine (--engine vllm)")
    group.add_argument(
        "--engine",
        default="flyspec",
        choices=("flyspec", "vllm"),
        help="flyspec's own engine (default), or vLLM: its own FLy where built in (0.34 and "
        "later), else flyspec's FLy plugin",
    )
    group.add_argument(
        "--vllm-dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="vLLM's weight dtype (default auto: the checkpoint's, bfloat16 for the default pair)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs the target is split over (vLLM's --tensor-parallel-size; default 1)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="vLLM's context length per request (default 4096; it sizes the KV cache)",
    )
    return group


def vllm_engine_spec(args: argparse.Namespace, config: cfg.DecodeConfig, *, mode: str):
    """The vLLM engine for these arguments in ``mode`` (the embedded default pair where
    --model/--draft-model are not given)."""
    from flyspec.integrations.vllm.launch import VllmEngineSpec, native_fly_version, require_vllm

    if config.auto_k:
        raise FlyspecError("-k auto runs in flyspec's own engine; give vLLM a fixed -k")
    require_vllm()
    target, draft = args.target, args.draft
    if target is None or (draft is None and config.drafter == "model" and mode != "target"):
        from flyspec.models import default_pair_paths

        defaults = default_pair_paths()
        target = target or str(defaults.target)
        draft = draft or str(defaults.draft)
    if args.max_model_len < 1:
        raise FlyspecError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    spec = VllmEngineSpec(
        target=target,
        draft=draft,
        mode=mode,
        drafter=config.drafter,
        k=config.k,
        fly=config.fly,
        dtype=None if args.vllm_dtype == "auto" else args.vllm_dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=config.sampling.seed or 0,
    )  # the flags checked before vLLM's configuration is imported (it prints on import)
    return dataclasses.replace(spec, native_fly=native_fly_version())


LOOSENING_OPTIONS = ("theta", "window", "min_ratio", "max_rank", "max_draft_confidence", "defer")
"""The destinations of the FLy rule's options (``flyspec eval`` takes lists of them)."""

RULE_OPTIONS = (*LOOSENING_OPTIONS, "entropy")
"""Every field of :class:`flyspec.config.FlyConfig`, by destination: what a calibration sets."""


Option = tuple[tuple[str, ...], dict]
"""An option's flags and the keyword arguments of its :func:`add_option`."""


DECODE_SECTIONS = {
    "speculation": "speculation (the method, its drafter, its block length and FLy's rule)",
    "beyond the paper": "FLy's rule beyond the paper (docs/rules.md; each off by default)",
    "sampling": "sampling",
    "length": "length (where a generation ends)",
}
"""The argument groups of the decoding options, by key, with their titles."""


def add_decode_arguments(
    parser: argparse.ArgumentParser,
    *,
    leave_out: Collection[str] = (),
    replace: Mapping[str, Option] | None = None,
) -> dict[str, argparse._ArgumentGroup]:
    """The decoding settings of :class:`flyspec.config.DecodeConfig` in the argument groups of
    :data:`DECODE_SECTIONS` (returned by key, for a command's own options), but those whose
    destination is in ``leave_out`` (a command that fixes them) and those ``replace`` gives in
    another form, by destination, in their place (``eval``'s lists).
    :func:`decode_config_from_args` gives the ones left out the config's defaults."""
    replace = replace or {}
    sections = {
        "speculation": [*_method_options(), *_fly_rule_options()],
        "beyond the paper": _beyond_paper_options(),
        "sampling": _sampling_options(),
        "length": _length_options(),
    }
    if set(RULE_OPTIONS) <= {*leave_out, *replace}:
        leave_out = {*leave_out, "no_calibration"}  # nothing left for a calibration to set
    groups = {}
    for key, options in sections.items():
        groups[key] = group = parser.add_argument_group(DECODE_SECTIONS[key])
        for flags, settings in options:
            dest = option_dest(flags, settings)
            if dest in replace:
                flags, settings = replace[dest]
            elif dest in leave_out:
                continue
            add_option(group, *flags, **settings)
    return groups


def option_dest(flags: Sequence[str], settings: Mapping[str, object]) -> str:
    """The destination argparse gives an option: its ``dest``, else its first long flag's."""
    if "dest" in settings:
        return str(settings["dest"])
    first = next(flag for flag in flags if flag.startswith("--"))
    return first.removeprefix("--").replace("-", "_")


def _method_options() -> list[Option]:
    """The decoding method, its drafter and the length of its draft blocks."""
    return [
        (("--mode",), dict(default="fly", choices=cfg.MODES, help="default: fly")),
        (("--drafter",), dict(default="model", choices=cfg.DRAFTERS, help="default: model")),
        (
            ("-k", "--num-speculative-tokens"),
            dict(
                aliases=("--k",),
                dest="k",
                type=block_size,
                default=cfg.DEFAULT_K,
                metavar="K",
                help="draft block length (default 15), or auto: chosen every round from 0 (the "
                "target alone) to 15, or to 64 along a prediction, for the most expected tokens "
                "per second",
            ),
        ),
    ]


def _fly_rule_options() -> list[Option]:
    """FLy's loosening rule as the paper gives it, and where it comes from (the pair's
    calibration or the paper)."""
    return [
        (
            ("--window",),
            dict(
                type=int,
                default=None,
                help="FLy deferred window W: matches needed after a loose token (default 6, "
                "or the pair's calibrated rule)",
            ),
        ),
        (
            ("--theta",),
            dict(
                type=number,
                default=None,
                help="FLy entropy threshold (default 0.3, or the pair's calibrated rule; "
                "inf = exact)",
            ),
        ),
        (
            ("--entropy",),
            dict(
                default=None,
                choices=cfg.ENTROPY_KINDS,
                help="gate entropy (default top3, or the pair's calibrated rule)",
            ),
        ),
        (
            ("--loosen-predicted",),
            dict(
                action="store_true",
                help="with a prediction (Predicted Outputs): FLy's rule applies to the tokens "
                "drafted from it too (default: they are verified exactly)",
            ),
        ),
        (
            ("--no-calibration",),
            dict(
                action="store_true",
                help="FLy's defaults are the paper's even where `flyspec calibrate` saved a "
                "rule for this pair",
            ),
        ),
    ]


def _beyond_paper_options() -> list[Option]:
    """The rules beyond the paper (docs/rules.md): plausibility floors, the draft's doubt and
    deferral across blocks."""
    return [
        (
            ("--min-ratio",),
            dict(
                type=number,
                default=None,
                help="plausibility floor: loosen a mismatch only where the target gives the "
                "draft token at least this fraction of its top token's probability "
                "(default 0: off, or the pair's calibrated rule)",
            ),
        ),
        (
            ("--max-rank",),
            dict(
                type=int,
                default=None,
                help="plausibility floor: loosen only draft tokens among the target's top N "
                "(default 0: off, or the pair's calibrated rule)",
            ),
        ),
        (
            ("--max-draft-confidence",),
            dict(
                type=number,
                default=None,
                help="the draft's doubt: loosen a mismatch only where the draft model gave its "
                "own token at most this probability (default 1: off, or the pair's calibrated "
                "rule)",
            ),
        ),
        (
            ("--defer",),
            dict(
                action=argparse.BooleanOptionalAction,
                default=None,
                help="carry a mismatch whose window does not fit in its block into the next "
                "block (its tokens are held back until the window completes, or rolled back; "
                "default off, or the pair's calibrated rule)",
            ),
        ),
    ]


def _sampling_options() -> list[Option]:
    """How the target and the draft pick their tokens, and where a draft block ends early."""
    return [
        (
            ("--temperature",),
            dict(type=number, default=0.0, help="target temperature (default 0: greedy)"),
        ),
        (("--top-k",), dict(type=int, default=0, help="top-k sampling (0 = off)")),
        (("--top-p",), dict(type=number, default=1.0, help="top-p sampling (1 = off)")),
        (
            ("--presence-penalty",),
            dict(
                type=number,
                default=0.0,
                help="subtracted once from a token's logit if it occurred in the answer, as "
                "OpenAI's (in [-2, 2]; default 0)",
            ),
        ),
        (
            ("--frequency-penalty",),
            dict(
                type=number,
                default=0.0,
                help="subtracted from a token's logit for each time it occurred in the answer, "
                "as OpenAI's (in [-2, 2]; default 0)",
            ),
        ),
        (
            ("--repetition-penalty",),
            dict(
                type=number,
                default=1.0,
                help="divides the positive logits (multiplies the negative ones) of tokens in "
                "the prompt or the answer, as vLLM's (> 0; default 1: off)",
            ),
        ),
        (
            ("--draft-temperature",),
            dict(
                type=number,
                default=0.0,
                help="sample the draft model at this temperature (default 0: greedy)",
            ),
        ),
        (
            ("--draft-confidence",),
            dict(
                type=number,
                default=0.0,
                help="end a draft block after a token the draft model gave a probability below "
                "this (default 0: always draft k tokens)",
            ),
        ),
        (("--seed",), dict(type=int, default=None, help="random seed for sampling")),
    ]


def _length_options() -> list[Option]:
    """Where a generation ends: its token budget and its stop strings."""
    return [
        max_tokens_option(
            default=cfg.DEFAULT_MAX_NEW_TOKENS,
            help=f"most tokens generated (default {cfg.DEFAULT_MAX_NEW_TOKENS})",
        ),
        (
            ("--stop",),
            dict(action="append", default=[], help="stop string (repeatable), not emitted"),
        ),
    ]


def max_tokens_option(*, default: int | None, help: str) -> Option:
    """--max-tokens (the token budget, ``max_new_tokens``), its former name --max-new-tokens
    kept as a hidden alias."""
    settings = dict(
        aliases=("--max-new-tokens",),
        dest="max_new_tokens",
        metavar="N",
        type=int,
        default=default,
        help=help,
    )
    return ("--max-tokens",), settings


def decode_config_from_args(args: argparse.Namespace, **fixed) -> cfg.DecodeConfig:
    """Validated settings (ConfigError on a bad value) from parsed arguments; ``fixed`` gives
    values by destination name (``theta=1.0``) for options the command left out or overrides,
    and an option neither parsed nor fixed keeps the config's default. FLy's rule starts from
    the pair's calibration (:func:`calibrated_rule`) where one exists and some of its options
    were not given."""
    values = {**vars(args), **fixed}
    given = {name: values[name] for name in RULE_OPTIONS if values.get(name) is not None}
    fly = cfg.FlyConfig()
    if len(given) < len(RULE_OPTIONS):
        calibration = calibrated_rule(values)
        if calibration is not None:
            fly = calibration.fly
    sampling = {
        name: values[name]
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        if name in values
    }
    decode = {
        name: values[name]
        for name in (
            "mode",
            "drafter",
            "k",
            "max_new_tokens",
            "draft_temperature",
            "draft_confidence",
            "loosen_predicted",
        )
        if name in values
    }
    if "stop" in values:
        decode["stop"] = tuple(values["stop"])
    if decode.get("k") == "auto":
        decode.update(k=cfg.DEFAULT_K, auto_k=True)
    return cfg.DecodeConfig(
        fly=dataclasses.replace(fly, **given), sampling=cfg.SamplingConfig(**sampling), **decode
    )


def calibrated_rule(values: Mapping[str, object]):
    """The :class:`~flyspec.calibration.Calibration` saved for the pair that ``target`` and
    ``draft`` name in ``values`` (parsed options; the default pair where they are None), or
    None: with --no-calibration, for a command without that option (``eval`` and
    ``calibrate`` set every rule explicitly), or where the pair has none. Says on stderr when
    it finds one."""
    from flyspec.calibration import calibration_path, load_calibration
    from flyspec.models import resolve_pair

    if values.get("no_calibration", True):
        return None
    try:
        target, draft = resolve_pair(values.get("target"), values.get("draft"))
    except FlyspecError:
        return None  # the default pair is not installed: loading it says so
    path = calibration_path(target, draft)
    calibration = load_calibration(path)
    if calibration is not None:
        say(
            f"FLy rule calibrated for this pair: {calibration.describe()}; from {path} "
            "(options given here override it, --no-calibration ignores it)"
        )
    return calibration
