"""``flyspec bench --prompt``: one prompt, the chosen method timed alternately with the target
alone and with llama.cpp's plain decoding of the same target, and whether the machine was quiet
enough to trust the speedup (the quick start's measurement)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from flyspec.config import DecodeConfig
from flyspec.errors import FlyspecError
from flyspec.support.console import say

DEFAULT_PAIRS = 2
"""Timed runs of the target alone and of the method each, alternated, where ``--repeats``
does not say."""


class TargetComparison:
    """The target alone and the chosen method (``label``) timed alternately, ``pairs`` times
    each (target, method, target, method, ...; the last method run is the one shown), with
    llama.cpp's plain decoding (``peers``) in the same alternation and what else used the CPU
    meanwhile.

    The speedup is the median of the per-pair ratios, with their range; where the machine was
    busy or the pairs disagree, :meth:`line` says so instead of stating one ratio as a fact.
    """

    def __init__(
        self, *, pairs: int, label: str = "method", peers: Sequence[PlainPeer] = ()
    ) -> None:
        from flyspec.support.machine import CpuMonitor

        self.pairs = pairs
        self.target: list = []  # GenerationResult of each run of the target alone
        self.method: list = []  # RequestStats of the method, the shown run last
        self.monitor = CpuMonitor(include_children=True)  # a llama-server peer runs in one
        self.peers = list(peers)
        self.label = label

    def start(
        self,
        engine,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        prediction: Sequence[int] | None = None,
    ):
        """Warm up, then run every timed generation but the last (shown) one (the method
        with ``prediction``, the target alone without)."""
        warm_up(engine, prompt_ids, config, prediction=prediction)
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
                say(f"timing {self.label} ({pair}/{self.pairs}) ...")
                method = engine.generate(prompt_ids, config, prediction=prediction)
                self.method.append(method.stats)
        say(f"running {self.label} ({self.pairs}/{self.pairs}), shown ...")
        return self

    def finish(self, shown_stats) -> dict:
        """Record the shown run; return the figures ``--json`` prints beside its result."""
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
            f" alternated with these; {self.label} here runs at {versus:.2f}x its speed"
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
            "Run again on a quiet machine, or with more --repeats."
        )


@dataclass
class PlainPeer:
    """llama.cpp's plain decoding of the same target, timed beside the method's runs:
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


def plain_llamacpp_peers(
    engine, config: DecodeConfig, *, default_target: bool, threads: int, context: int
) -> list[PlainPeer]:
    """llama.cpp's plain decoding of the same target where it can run and the target's GGUF
    file is known (the llama.cpp engine's, or the default pair's when installed and
    ``default_target``): by llama-server (where it is built) first, then by the binding (where
    it is installed), with ``threads`` (0: every core this process may use) and ``context``.
    The comparison is a bonus: where one cannot start, a warning says why and it is left
    out."""
    from flyspec.bench.methods import LlamaCppOwnMethod
    from flyspec.models.llamacpp_binding import llamacpp_version

    if engine.backend == "llamacpp":
        path = engine.decoder.target.path
    elif default_target:
        from flyspec.models.default_pair import DEFAULT_TARGET
        from flyspec.models.mirror import gguf_path, is_gguf_installed

        if not is_gguf_installed(DEFAULT_TARGET):
            return []
        path = gguf_path(DEFAULT_TARGET)
    else:
        return []
    if not threads:
        from flyspec.models.llamacpp import default_threads

        threads = default_threads()
    peers = []
    if llama_server_built():
        from flyspec.bench.llama_server import LlamaServerMethod, ServerSetup

        try:
            server = LlamaServerMethod(
                "llama-server",
                ServerSetup(target=path, threads=threads, context=context),
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
                context=context,
                eos_token_ids=engine.decoder.eos_token_ids,
                config=config,
            )
            label = "llama.cpp's Python binding"
            peers.append(PlainPeer(label, "llamacpp", binding, binding.weights))
        except FlyspecError as error:
            print(f"flyspec: warning: llama.cpp's line left out: {error}", file=sys.stderr)
    return peers


def warm_up(
    engine,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    *,
    prediction: Sequence[int] | None = None,
) -> None:
    """A few tokens in each mode first, so one-time costs do not bias the comparison (and a
    prediction the request cannot take is refused before any timed run)."""
    engine.generate(prompt_ids, config.with_updates(mode="target", max_new_tokens=2))
    engine.generate(prompt_ids, config.with_updates(max_new_tokens=2), prediction=prediction)
