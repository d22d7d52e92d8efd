"""``flyspec generate``: one prompt, streamed, with the statistics of the round."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from flyspec import config as cfg
from flyspec.cli.options import (
    add_backend_arguments,
    add_chat_argument,
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    forward_threads,
    load_engine,
    say,
)
from flyspec.errors import FlyspecError
from flyspec.support.resident_memory import peak_rss_bytes

ORIGIN_COLOURS = {
    "exact": "\033[32m",  # green
    "loose": "\033[33m",  # yellow
    "correction": "\033[31m",  # red
    "bonus": "\033[36m",  # cyan
}
RESET = "\033[0m"


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``generate`` to the ``flyspec`` subcommands."""
    generate = commands.add_parser(
        "generate", help="generate text for one prompt, streamed, with statistics"
    )
    generate.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    add_model_arguments(generate)
    prompt = generate.add_argument_group("prompt")
    add_chat_argument(
        prompt,
        default=None,
        help="wrap the prompt in the tokenizer's chat template (default: when it has one)",
    )
    prompt.add_argument(
        "--prediction",
        metavar="FILE",
        help="a file holding text the answer is expected to largely repeat, such as the code "
        "being edited ('-' reads standard input): drafts come from it first (Predicted Outputs)",
    )
    answer = prompt.add_mutually_exclusive_group()
    answer.add_argument(
        "--json-schema",
        metavar="FILE",
        help="a file holding a JSON schema: the answer is JSON that follows it (structured "
        "outputs: the target's and the draft's tokens masked by its grammar)",
    )
    answer.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    add_decode_arguments(generate)
    output = generate.add_argument_group("output")
    shown = output.add_mutually_exclusive_group()
    shown.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, token_ids and stats on stdout instead of "
        "streaming the text (as bench --json prints its report instead of the table)",
    )
    shown.add_argument(
        "--show",
        action="store_true",
        help="colour each token by how it was obtained (exact, loose, correction, bonus)",
    )
    output.add_argument(
        "--compare-target",
        action="store_true",
        help="also time the target alone on the same prompt, alternating with the chosen "
        "method, and report the speedup (median and range) and whether the machine was busy",
    )
    output.add_argument(
        "--compare-pairs",
        type=int,
        default=2,
        help="with --compare-target: timed runs of each, alternated (default 2)",
    )
    add_backend_arguments(generate)
    generate.set_defaults(handler=run_generate)
    return generate


def run_generate(args: argparse.Namespace) -> int:
    config = decode_config_from_args(args)
    if args.prompt == "-" and args.prediction == "-":
        raise FlyspecError("the prompt and --prediction cannot both be read from standard input")
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise FlyspecError("the prompt is empty")
    prediction = None if args.prediction is None else read_prediction(args.prediction)
    if args.compare_target and args.compare_pairs < 1:
        raise FlyspecError(f"--compare-pairs must be >= 1, got {args.compare_pairs}")
    schema = read_schema(args.json_schema) if args.json_schema is not None else None
    wants_json = schema is not None or args.json_object
    if wants_json and args.compare_target:
        raise FlyspecError("--compare-target times unconstrained answers: leave out --json-*")
    engine = load_engine(args, with_draft=config.uses_draft_model or args.compare_target)
    grammar = engine.json_grammar(schema) if wants_json else None
    prompt_ids = engine.encode(prompt, chat=args.chat)
    prediction_ids = None if prediction is None else engine.encode_prediction(prediction)
    comparison = None
    if args.compare_target:
        comparison = TargetComparison(
            pairs=args.compare_pairs, peers=plain_llamacpp_peers(args, engine, config)
        )
    try:
        return _generate(args, engine, config, prompt_ids, prediction_ids, comparison, grammar)
    finally:
        if comparison is not None:
            comparison.close()


def _generate(
    args: argparse.Namespace,
    engine,
    config: cfg.DecodeConfig,
    prompt_ids: list[int],
    prediction_ids: list[int] | None,
    comparison: TargetComparison | None,
    grammar=None,
) -> int:
    """The generation (following ``grammar`` where given), timed beside the target alone and
    llama.cpp where ``comparison``."""
    if comparison is not None:
        comparison.start(engine, prompt_ids, config, prediction=prediction_ids)

    if args.json:
        result = engine.generate(prompt_ids, config, prediction=prediction_ids, grammar=grammar)
        payload = result.as_dict()
        if comparison is not None:
            payload.update(comparison.finish(result.stats))
        payload["peak_rss_bytes"] = peak_rss_bytes()  # this process, models loaded and run
        print(json.dumps(payload, ensure_ascii=False))
        return 0

    from flyspec.decoding.stats import RequestStats

    stats = RequestStats()
    if args.show:
        say(
            "colours: "
            + ", ".join(f"{colour}{origin}{RESET}" for origin, colour in ORIGIN_COLOURS.items())
        )
    chunks = engine.stream(
        prompt_ids, config, stats=stats, prediction=prediction_ids, grammar=grammar
    )
    for chunk in chunks:
        text = chunk.text
        if args.show and text:
            text = f"{ORIGIN_COLOURS[chunk.origin]}{text}{RESET}"
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    say(f"[{config.mode}] {stats.summary_line()}")
    if prediction_ids is not None:
        say(
            f"prediction: {len(prediction_ids)} tokens; "
            f"{stats.accepted_prediction_tokens} of its drafted tokens kept, "
            f"{stats.rejected_prediction_tokens} rejected"
        )
    if comparison is not None:
        comparison.finish(stats)
        say(comparison.line())
    return 0


class TargetComparison:
    """``--compare-target``: the target alone and the chosen method timed alternately,
    ``pairs`` times each (target, method, target, method, ...; the last method run is the
    one shown), with what else used the CPU meanwhile.

    The speedup is the median of the per-pair ratios, with their range; where the machine was
    busy or the pairs disagree, :meth:`line` says so instead of stating one ratio as a fact.
    """

    def __init__(self, *, pairs: int, peers: Sequence[PlainPeer] = ()) -> None:
        from flyspec.support.machine import CpuMonitor

        self.pairs = pairs
        self.target: list = []  # GenerationResult of each run of the target alone
        self.method: list = []  # RequestStats of the method, the shown run last
        self.monitor = CpuMonitor(include_children=True)  # a llama-server peer runs in one
        self.peers = list(peers)
        self.mode = "method"

    def start(
        self,
        engine,
        prompt_ids: Sequence[int],
        config: cfg.DecodeConfig,
        *,
        prediction: Sequence[int] | None = None,
    ):
        """Warm up, then run every timed generation but the last (shown) one (the method
        with ``prediction``, the target alone without)."""
        warm_up(engine, prompt_ids, config, prediction=prediction)
        self.mode = config.mode
        for peer in self.peers:
            peer.method.run(prompt_ids, max_new_tokens=2, seed=config.sampling.seed)  # warm-up
        self.monitor.start()
        for pair in range(1, self.pairs + 1):
            say(f"timing the target alone ({pair}/{self.pairs}) ...")
            baseline = engine.generate(prompt_ids, config.with_updates(mode="target"))
            say(f"target alone: {baseline.stats.summary_line()}")
            self.target.append(baseline)
            for peer in self.peers:
                say(f"timing {peer.label}'s plain decoding ({pair}/{self.pairs}) ...")
                run = peer.method.run(
                    prompt_ids, max_new_tokens=config.max_new_tokens, seed=config.sampling.seed
                )
                peer.speeds.append(len(run.token_ids) / run.seconds if run.seconds else 0.0)
            if pair < self.pairs:
                say(f"timing {config.mode} ({pair}/{self.pairs}) ...")
                method = engine.generate(prompt_ids, config, prediction=prediction)
                self.method.append(method.stats)
        say(f"running {config.mode} ({self.pairs}/{self.pairs}), shown ...")
        return self

    def finish(self, shown_stats) -> dict:
        """Record the shown run; return the figures for ``--json``."""
        from flyspec.support.repeated_measurements import Spread, ratio_spread

        self.method.append(shown_stats)
        self.load = self.monitor.stop()
        method_speeds = [stats.tokens_per_second for stats in self.method]
        target_speeds = [result.stats.tokens_per_second for result in self.target]
        self.ratios = ratio_spread(method_speeds, target_speeds)
        self.target_speed, self.method_speed = Spread.of(target_speeds), Spread.of(method_speeds)
        extra = {}
        for peer in self.peers:
            extra[f"{peer.key}_tokens_per_second"] = [round(v, 4) for v in peer.speeds]
            extra[f"{peer.key}_weights"] = peer.weights
        return {
            **extra,
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
        """A quiet machine, and pairs that agree: closely, or at least on the direction and
        the size of the speedup (:attr:`~flyspec.support.repeated_measurements.Spread.agrees`)."""
        return not self.load.busy and (not self.ratios.unstable or self.ratios.agrees)

    def line(self) -> str:
        """The closing line: the speedup, or why it cannot be trusted; then the speed of
        llama.cpp's plain decoding, by its server and by its binding, where they ran."""
        return self._speedup_line() + "".join(self._peer_line(peer) for peer in self.peers)

    def _peer_line(self, peer: PlainPeer) -> str:
        from flyspec.support.repeated_measurements import Spread

        speed = Spread.of(peer.speeds)
        versus = self.method_speed.median / speed.median if speed.median else math.nan
        return (
            f"\n{peer.label}, plain decoding of the same target ({peer.weights}): "
            f"{speed.median:.2f} tok/s, median of {speed.count} run{'s' if speed.count > 1 else ''}"
            f" alternated with these; {self.mode} here runs at {versus:.2f}x its speed"
        )

    def close(self) -> None:
        """Stop the peers that run as servers."""
        for peer in self.peers:
            close = getattr(peer.method, "close", None)
            if close is not None:
                close()

    def _speedup_line(self) -> str:
        speeds = (
            f"{self.method_speed.median:.2f} vs {self.target_speed.median:.2f} tok/s, medians "
            f"of {self.pairs} alternated run{'s' if self.pairs > 1 else ''} each"
        )
        if self.reliable and self.ratios.unstable:
            return (
                f"speedup over the target alone: {self.ratios.low:.2f}x to "
                f"{self.ratios.high:.2f}x over {self.pairs} alternated pairs ({speeds})"
            )
        if self.reliable:
            return f"speedup over the target alone: {self.ratios.describe(unit='x')} ({speeds})"
        why = []
        if self.load.busy:
            why.append(
                f"the machine was busy (other processes used "
                f"{self.load.others_cpu_fraction:.0%} of the CPU)"
            )
        if self.ratios.unstable and not self.ratios.agrees:
            why.append(
                f"the {self.pairs} pairs disagree ({self.ratios.low:.2f}x to "
                f"{self.ratios.high:.2f}x)"
            )
        return (
            f"speedup over the target alone NOT measured reliably: {' and '.join(why)}; "
            f"this run gave {self.ratios.low:.2f}x to {self.ratios.high:.2f}x ({speeds}). "
            "Run again on a quiet machine, or with more --compare-pairs."
        )


@dataclass
class PlainPeer:
    """llama.cpp's plain decoding of the same target, timed beside the quick start's runs:
    ``method`` (a bench method), what the closing line calls it, and its speeds."""

    label: str
    key: str  # of its figures in --json
    method: object
    weights: str
    speeds: list[float] = field(default_factory=list)


def llama_server_built() -> bool:
    """Whether there is a llama-server to run (built, named or on the PATH)."""
    from flyspec.bench.llama_server import llama_server_binary

    try:
        llama_server_binary()
    except FlyspecError:
        return False
    return True


def plain_llamacpp_peers(args: argparse.Namespace, engine, config: cfg.DecodeConfig) -> list:
    """llama.cpp's plain decoding of the same target where it can run and the target's GGUF
    file is known (the llama.cpp backend's, or the default pair's when installed): by
    llama-server (where it is built) first, then by the binding (where it is installed). The
    comparison is a bonus: where one cannot start, a warning says why and it is left out."""
    from flyspec.bench.methods import LlamaCppOwnMethod
    from flyspec.models.llamacpp_binding import llamacpp_version

    if engine.backend == "llamacpp":
        path = engine.decoder.target.path
    elif args.target is None:
        from flyspec.models.default_pair import DEFAULT_TARGET
        from flyspec.models.mirror import gguf_path, is_gguf_installed

        if not is_gguf_installed(DEFAULT_TARGET):
            return []
        path = gguf_path(DEFAULT_TARGET)
    else:
        return []
    threads = forward_threads(args)
    if not threads:
        from flyspec.models.llamacpp import default_threads

        threads = default_threads()
    peers = []
    if llama_server_built():
        from flyspec.bench.llama_server import LlamaServerMethod, ServerSetup

        try:
            server = LlamaServerMethod(
                "llama-server",
                ServerSetup(target=path, threads=threads, context=args.llamacpp_context),
                k=1,  # plain decoding drafts nothing
                eos_token_ids=engine.decoder.eos_token_ids,
                sampling=config.sampling,
            )
            say("starting llama-server for the comparison ...")
            peers.append(PlainPeer("llama-server", "llama_server", server.start(), path.name))
        except FlyspecError as error:
            print(f"flyspec: warning: llama-server's line left out: {error}", file=sys.stderr)
    if llamacpp_version() is not None:
        try:
            binding = LlamaCppOwnMethod(
                "llamacpp-target",
                gguf=path,
                threads=threads,
                context=args.llamacpp_context,
                eos_token_ids=engine.decoder.eos_token_ids,
                config=config,
            )
            label = "llama.cpp's Python binding"
            peers.append(PlainPeer(label, "llamacpp", binding, binding.weights))
        except FlyspecError as error:
            print(f"flyspec: warning: llama.cpp's line left out: {error}", file=sys.stderr)
    return peers


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


def read_schema(path: str) -> dict:
    """The JSON schema in the file ``path`` (FlyspecError naming the problem)."""
    try:
        with open(path, encoding="utf-8") as handle:
            schema = json.load(handle)
    except OSError as error:
        raise FlyspecError(f"cannot read the schema file {path}: {error.strerror}") from None
    except ValueError as error:
        raise FlyspecError(f"the schema file {path} is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise FlyspecError(f"the schema file {path} holds no JSON object (a schema is one)")
    return schema


def read_prediction(argument: str) -> str:
    """The text of ``--prediction``: a UTF-8 file, or standard input for ``-``."""
    if argument == "-":
        data, source = sys.stdin.buffer.read(), "standard input"
    else:
        source = f"the prediction file {argument}"
        try:
            with open(argument, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise FlyspecError(f"cannot read {source}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FlyspecError(
            f"{source} is not valid UTF-8: byte 0x{data[error.start]:02x} at offset {error.start}"
        ) from None
    if not text:
        raise FlyspecError(f"{source} is empty: give the text the answer should repeat")
    return text


def warm_up(
    engine,
    prompt_ids: Sequence[int],
    config: cfg.DecodeConfig,
    *,
    prediction: Sequence[int] | None = None,
) -> None:
    """A few tokens in each mode first, so one-time costs do not bias the comparison (and a
    prediction the request cannot take is refused before any timed run)."""
    engine.generate(prompt_ids, config.with_updates(mode="target", max_new_tokens=2))
    engine.generate(prompt_ids, config.with_updates(max_new_tokens=2), prediction=prediction)
