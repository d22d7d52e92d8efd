"""The first GPU figures in one run: forward costs, flyspec's engine against the bandwidth
bound, the decoding loop's own cost per round, the compiled forward, and speed at the real
pair's recorded acceptance (trace replay), with the checks that the engine's tokens are right.

No weights travel: the models are random-weight models with the shapes of the default pair
(Qwen2.5-Coder 0.5B drafting, 1.5B target) and of a 7B and a 32B Qwen2.5 target
(``benchmarks/gpu_configs/*/config.json``), built in bfloat16 on the device::

    bash benchmarks/name_tree.sh                                 # before: names the tree's commit
    python benchmarks/gpu_first_look.py                          # a CUDA GPU (not yet timed)
    python benchmarks/gpu_first_look.py --quick                  # the goals' rows only
    python benchmarks/gpu_first_look.py --targets 1.5b,7b        # a subset of the targets
    python benchmarks/gpu_first_look.py --device cpu --rehearse --quick   # the lease, rehearsed
    python benchmarks/gpu_first_look.py --device cpu --tiny      # tiny shapes on the CPU

``--rehearse`` runs on the CPU the sequence a lease runs, with or without ``--quick``: the same
distinct models, each with its real layers, heads and vocabulary and a width of its own
(:data:`REHEARSAL_WIDTH_DIVISOR`), in the same dtypes (bfloat16, and float32 for the same
tokens), the same phases and the same compiles in the same order, with no time limit: what
would stop a lease on a GPU (a compile that fails, a model that cannot build) stops it here
first. ``--tiny`` is a quicker check of the script: every model of one tiny shape, so one
model's graphs serve all (it cannot see what each new shape costs).

It prints one table (Markdown) and writes it as ``gpu_first_look.json`` and
``gpu_first_look.md`` under ``$OUT`` when that is set, and under ``--output DIR``. Progress goes
to stderr. A phase that fails (out of memory, say) is a row marked failed with its reason, and
the other phases go on; phases that would start after ``--time-limit`` seconds are skipped. The
rows name flyspec's commit (:func:`flyspec.support.machine.git_commit`: the checkout's, or the
``TREE_COMMIT`` file ``benchmarks/name_tree.sh`` writes into a copy; else "unknown").

The rows, by phase (``--quick``: the attention, compiled and replay phases with the replays of
:data:`QUICK_REPLAYS`, the targets largest first, then the same tokens' lossless and compiled
rows; every phase says on stderr how long it took and the graphs it compiled):

- ``bandwidth``: a device-to-device copy of one large tensor (CUDA events, median), counting
  the bytes read and written, as the ceiling of a memory-bound forward.
- ``model``: each random model built, the bytes a one-token forward reads (every weight but the
  input embedding table, plus the KV cache of the context), and a check that its logits are
  finite.
- ``same tokens``: every drafter and rule on the device, in float32, with the draft and the
  1.5B-shaped target (seeded apart) and a prompt that repeats itself: exact SPD with the draft
  model, with the target drafting for itself, with n-gram drafting and with the target's own
  answer as the prediction must each give the target alone's greedy tokens (where one does
  not, the row fails with the target's top-2 logit margin at the first difference: a near tie
  can flip between forwards of different sizes); FLy with the draft model, with MLA, with
  ``-k auto`` and sampled only have to run. Then the target alone on the compiled forward
  against the eager one (the same tokens, or a first difference at a near tie under
  :data:`NEAR_TIE`, else failed; with the compiled forward's own check of its first forwards),
  and exact SPD with the draft model and with the prediction on the compiled forward, which
  must give the compiled target alone's tokens.
- ``forward cost``: ``V(n)``, the target's forward over n = 1..16 new tokens after 300
  cached ones (24 in the tiny form) through flyspec's lean forward
  (:func:`flyspec.bench.forward_cost.measure_forward_cost`, the device waited for around each
  timed forward), and ``d``, the draft's one-token forward.
- ``engine alone``: flyspec's :class:`~flyspec.decoding.loop.SpeculativeDecoder` in mode
  target, greedy, eager: its time per token next to the bound (bytes read per token over the
  copy bandwidth); of that time, the forwards' device time (CUDA events around every forward)
  and the rest, the loop's.
- ``profile``: the first target's eager one-token forward under torch's profiler, timed alone
  and inside the decoder: host time, kernel launches and device time per token, and the
  operators with the most host time (where a forward inside the decoder loses its time).
- ``loop overhead``: the target drafting for itself (a draft model that agrees with the target,
  FLy at block size K): per round, the wall time minus the device time of its forwards, which
  is the time the device waits for the loop (its Python, verification, host synchronisations),
  and the host synchronisations per round (on CUDA: the calls
  ``torch.cuda.set_sync_debug_mode`` reports, counted in a separate untimed run).
- ``projection``: not a measurement. FLy's and exact SPD's speedup over the target alone, from
  the tau flyspec measured on the real pair on a CPU (``gpu_configs/measured_tau.json``) and
  the costs above, with ``benchmarks/break_even.py``'s cost of a round (``K * d + V(K+1)``
  for tau tokens, against ``V(1)`` a token); once from the forwards alone, once with the
  engine's measured time per target token and the loop's overhead per round added.
- ``kernel check``: vLLM 0.34's FLy kernel against flyspec's rule on random conformance
  batches (``benchmarks/vllm_fly_gpu.py``), when its files were extracted into
  ``benchmarks/vllm_fly_kernels``.
- ``attention``: for each target, the attention the compiled forward runs at 1, 16 and 65 new
  tokens (over the whole reserved buffer, a bool mask, grouped-query heads): the kernel torch
  dispatches to, its time, each kernel forced in turn (math, memory-efficient, flash, cuDNN;
  those that refuse the shape say so), and the same attention over the live positions alone.
- ``compiled``: each target through the compiled forward (``--forward compiled``, the default
  on CUDA: ``torch.compile``, CUDA graphs on a GPU): alone, against the bound and the eager
  row of the same run; its ``V(n)`` at the compiled sizes up to 65 (a prediction's block of 64
  and the token before it); the first target drafting for itself at K=8 (the loop's time and
  host synchronisations per round). Each row with the graphs compiled, on CUDA how many ran
  without a CUDA graph, the time the row took with compiling, and how many of its tokens are
  the eager decode's (told, not failed: compiling reorders the arithmetic).
- ``replay``: the traces of :data:`REPLAYS` (``benchmarks/traces``, recorded on the real pair
  by ``benchmarks/record_traces.py``) replayed on each target with the 0.5B-shaped draft, both
  compiled (:class:`flyspec.bench.replay.ReplayDecoder`): every draft, forward and
  verification runs, and each round keeps what the trace says. Tokens per second against the
  compiled target alone on the same prompts: speed *at the real pair's recorded acceptance*,
  never the real pair's speed.
- ``compiles``: per model (name and dtype), the graphs its phases compiled and each compile's
  seconds, cold or from inductor's cache; failed where a compile failed or, with a shape of
  its own, where the model compiled nothing.
- ``goal``: last, one row per goal of the GPU engine (:data:`GOALS`, and the same tokens of
  exact decoding): met, missed or not run, with its figure (on the CPU, a rehearsal of the
  table, not a GPU figure).

Windows of a decode start after its first round, so that neither the prompt's prefill nor the
first round's start-up counts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import io
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
sys.path.insert(0, str(ROOT / "src"))

from flyspec.bench.forward_cost import measure_forward_cost, time_forwards  # noqa: E402
from flyspec.bench.replay import ReplayDecoder, Trace, load_traces  # noqa: E402
from flyspec.config import DecodeConfig, SamplingConfig  # noqa: E402
from flyspec.decoding.loop import SpeculativeDecoder  # noqa: E402
from flyspec.decoding.stats import RequestStats  # noqa: E402
from flyspec.errors import error_line  # noqa: E402
from flyspec.models.cache import (  # noqa: E402
    CachedLM,
    ForwardRunner,
    common_prefix_length,
    make_forward,
)
from flyspec.models.lean import COMPILED_SIZES  # noqa: E402
from flyspec.models.timing import device_clock, wait_for_device  # noqa: E402
from flyspec.support.machine import git_commit  # noqa: E402

CONFIGS = BENCHMARKS / "gpu_configs"
TRACES = BENCHMARKS / "traces"
REPLAYS = {
    "1.5b": (("humaneval", "fly@15"), ("humaneval", "spd@15"), ("humaneval-edit", "predict@64")),
    "7b": (
        ("humaneval", "fly@15"),
        ("humaneval-edit", "predict@15"),
        ("humaneval-edit", "predict@64"),
        ("humaneval-edit", "predict-draft@15"),
    ),
    "32b": (
        ("humaneval", "fly@8"),
        ("humaneval", "fly@15"),
        ("humaneval", "spd@15"),
        ("humaneval-edit", "predict@64"),
        ("humaneval-edit", "predict-draft@15"),
    ),
}
"""The recorded traces (``benchmarks/traces/<set>.json``, ``benchmarks/record_traces.py``)
replayed on each target shape; ``--quick`` replays those the goals name."""
QUICK_REPLAYS = {
    "7b": (("humaneval-edit", "predict@64"), ("humaneval-edit", "predict-draft@15")),
    "32b": (("humaneval", "fly@15"),),
}
QUICK_ORDER = ("32b", "7b", "1.5b")
"""``--quick`` measures the targets in this order: the goals' largest rows first, so that a
run cut short by its time limit has them."""
NEAR_TIE = 1e-3
"""A top-2 logit margin below this is a near tie that float32 rounding can flip: a compiled
float32 decode that leaves the eager one there is told, not failed."""
TAU_FILE = CONFIGS / "measured_tau.json"
KERNELS = BENCHMARKS / "vllm_fly_kernels"
DRAFT = "0.5b"
MODELS = {
    DRAFT: "qwen2.5-coder-0.5b-instruct",
    "1.5b": "qwen2.5-coder-1.5b-instruct",
    "7b": "qwen2.5-7b-instruct",
    "32b": "qwen2.5-32b-instruct",
}
TARGETS = ("1.5b", "7b", "32b")
OVERHEAD_KS = (4, 8, 15)
COMPILED_K = 8
SAME_TOKENS_TARGET = "1.5b"
SAME_TOKENS_K = 8
COMPILE_BUDGET_S = {"32b": 160, "7b": 80, "1.5b": 80, "0.5b": 60}
"""What a phase that compiles a model's two graphs is given before the time limit, by model:
the CPU rehearsal's cold compile of the model's shape (2-core Xeon, 2026-12-05), which the
lent H200 matched or beat 1-3x on the one graph it compiled (docs/benchmarks.md, "The lease
rehearsed on the CPU"). A phase that would end past the limit is skipped, so that a cut
``--quick`` keeps its largest targets' rows."""
MAX_NEW_TOKENS = 16  # V(n) for n = 1 .. 16: a block of 15 drafted tokens and the last one
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
REHEARSAL_WIDTH_DIVISOR = 16
"""``--rehearse``: every model with its real layers, heads, key-value heads and vocabulary, its
hidden and MLP widths divided by this (head dimensions of 4 and 8 instead of 64 and 128): a
shape of its own for each model, as on the GPU, so that a CPU compiles what the GPU would."""
SHAPES = ("real", "rehearsal", "tiny")
SYNC_WARNING = "synchronizing CUDA operation"


@dataclass(frozen=True)
class Sizes:
    """How much each phase runs: the full form on a GPU, or the tiny form on a CPU."""

    context: int
    repeats: int
    warmup: int
    engine_tokens: int
    overhead_tokens: int
    sync_tokens: int
    copy_bytes: int
    kernel_batches: int
    kernel_vocab: int
    same_tokens: int
    replay_requests: int | None  # None: every request of a trace


FULL = Sizes(
    context=300,
    repeats=7,
    warmup=2,
    engine_tokens=96,
    overhead_tokens=160,
    sync_tokens=48,
    copy_bytes=4 << 30,
    kernel_batches=60,
    kernel_vocab=151936,
    same_tokens=48,
    replay_requests=None,
)
QUICK_REPLAY_REQUESTS = 4
TINY = Sizes(
    context=24,
    repeats=2,
    warmup=1,
    engine_tokens=16,
    overhead_tokens=40,
    sync_tokens=20,
    copy_bytes=16 << 20,
    kernel_batches=9,
    kernel_vocab=64,
    same_tokens=24,
    replay_requests=1,
)


@dataclass
class Row:
    """One line of the table: a phase, what it measured, ``ok``/``failed``/``skipped``, the
    headline and its detail, and the numbers behind them (JSON only)."""

    phase: str
    subject: str
    status: str
    result: str
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)


class PhaseSkipped(Exception):
    """A phase not run, with the reason (a row marked skipped)."""


def log(message: str) -> None:
    print(f"[gpu_first_look] {message}", file=sys.stderr, flush=True)


def release_memory(device: torch.device) -> None:
    """Give the freed device memory back before the next, possibly larger, model."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_script(name: str) -> ModuleType:
    """A script of ``benchmarks/`` (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant digits."""
    ms = 1000 * seconds
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def fmt_count(value: float, unit: str) -> str:
    """``value`` with three significant digits and a decimal prefix: ``1.54 GB``; a count of
    parameters in billions or millions: ``1.54 B parameters``."""
    if unit == "parameters":
        return f"{value / 1e9:.3g} B {unit}" if value >= 1e8 else f"{value / 1e6:.3g} M {unit}"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


# --------------------------------------------------------------------------- timing


def timed(device: torch.device, work: Callable[[], object]) -> float:
    """Seconds the device spends on ``work`` (CUDA events; wall time on the CPU)."""
    if device.type != "cuda":
        started = time.perf_counter()
        work()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


@dataclass(frozen=True)
class ForwardRecord:
    """One forward: when the host issued it, and its time (measured, or its CUDA events)."""

    issued: float
    seconds: float | None = None  # the CPU's forwards are timed on the spot
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def device_seconds(self) -> float:
        if self.events is None:
            return self.seconds
        start, end = self.events
        return start.elapsed_time(end) / 1000


class TimedRunner:
    """A :class:`~flyspec.models.cache.ForwardRunner` that times every forward of the runner
    it wraps: CUDA events around it on a GPU (the device's time, no synchronisation added),
    wall time on the CPU, where a forward is done when it returns."""

    def __init__(self, inner: ForwardRunner) -> None:
        self.inner = inner
        self.forward_path = inner.forward_path
        self.model = inner.model
        self.device = inner.device
        self.context_length = inner.context_length
        self.records: list[ForwardRecord] = []

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def reset(self) -> None:
        self.inner.reset()

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def reserve(self, positions: int) -> None:
        self.inner.reserve(positions)

    def state_bytes(self) -> int:
        return self.inner.state_bytes()

    def forward(self, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Logits ``[num_logits, V]`` of the wrapped runner, the call recorded."""
        issued = time.perf_counter()
        if self.device.type != "cuda":
            logits = self.inner.forward(input_ids, num_logits)
            self.records.append(ForwardRecord(issued, seconds=time.perf_counter() - issued))
            return logits
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self.inner.forward(input_ids, num_logits)
        end.record()
        self.records.append(ForwardRecord(issued, events=(start, end)))
        return logits

    def device_seconds(self, since: float) -> float:
        """The forwards' device time, of those issued at ``since`` or later (after the device
        has finished them)."""
        return sum(r.device_seconds() for r in self.records if r.issued >= since)


def timed_lm(model: torch.nn.Module, forward_path: str = "lean") -> tuple[CachedLM, TimedRunner]:
    """A :class:`CachedLM` over the forward ``forward_path`` of ``model`` (the decoder's
    default: lean), timed."""
    runner = TimedRunner(make_forward(model, forward_path))
    return CachedLM(runner), runner


@contextlib.contextmanager
def sync_counter(device: torch.device) -> Iterator[Callable[[], int] | None]:
    """Count host synchronisations on CUDA: torch reports each synchronising call (a copy to or
    from the host that waits for the device, ``.item()``, ``nonzero``...) as a warning in its
    sync debug mode. Yields a function reading the count so far; None on other devices."""
    if device.type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:

            def count() -> int:
                return sum(SYNC_WARNING in str(w.message) for w in caught)

            probe = torch.ones(1, device=device)
            probe.item()
            probe.item()  # two known synchronisations: is each one reported?
            seen = count()
            yield (lambda: count() - seen) if seen == 2 else None
        finally:
            torch.cuda.set_sync_debug_mode("default")


@dataclass(frozen=True)
class Window:
    """A decode from the end of its first round to its last token: wall seconds, the device
    seconds of the forwards issued in it, its rounds, tokens, drafted and kept tokens, the
    host synchronisations counted in it (None: not counted), and the ids of every token the
    decode gave, the first round's included."""

    seconds: float
    forward_seconds: float
    rounds: int
    tokens: int
    drafted: int
    kept: int
    syncs: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AfterFirstRound:
    """A request's tokens as they came: from the end of its first round (after the prompt's
    prefill and the first round's start-up) to its last token, the wall seconds, the tokens
    and the host synchronisations (None: not counted); the clock at its start; and the ids of
    every token, the first round's included."""

    started: float
    seconds: float
    tokens: int
    syncs: int | None
    token_ids: tuple[int, ...]


def after_first_round(
    events: Iterator, stats: RequestStats, syncs: Callable[[], int] | None = None
) -> AfterFirstRound:
    """Consume a request's ``events`` (``stats`` its statistics, filled as it runs), with
    ``syncs`` reading the host synchronisations so far where they are counted."""
    marks: list[tuple[int, float, int]] = []  # (rounds so far, time, syncs so far) per token
    token_ids: list[int] = []
    for event in events:
        marks.append((stats.num_rounds, time.perf_counter(), syncs() if syncs else 0))
        token_ids.append(event.token)
    first = max(i for i, (rounds, _, _) in enumerate(marks) if rounds == 1)
    return AfterFirstRound(
        started=marks[first][1],
        seconds=marks[-1][1] - marks[first][1],
        tokens=len(marks) - 1 - first,
        syncs=marks[-1][2] - marks[first][2] if syncs is not None else None,
        token_ids=tuple(token_ids),
    )


def decode_window(
    decoder: SpeculativeDecoder,
    runners: Sequence[TimedRunner],
    prompt: Sequence[int],
    config: DecodeConfig,
    *,
    count_syncs: bool = False,
) -> Window:
    """Run one greedy request and measure it after its first round (:class:`Window`); with
    ``count_syncs``, count its host synchronisations instead of timing it (CUDA only; None
    where torch does not report them)."""
    device = decoder.target.device
    stats = RequestStats()
    for runner in runners:
        runner.records.clear()
    with sync_counter(device if count_syncs else torch.device("cpu")) as syncs:
        run = after_first_round(decoder.stream(prompt, config, stats=stats), stats, syncs)
    wait_for_device(device)
    if run.tokens == 0:
        count = len(run.token_ids)
        raise RuntimeError(f"the request took one round ({count} tokens): no window")
    later = stats.rounds[1:]
    return Window(
        seconds=run.seconds,
        forward_seconds=sum(runner.device_seconds(run.started) for runner in runners),
        rounds=len(later),
        tokens=run.tokens,
        drafted=sum(r.drafted for r in later),
        kept=sum(r.accepted + r.loosely_accepted for r in later),
        syncs=run.syncs,
        token_ids=run.token_ids,
    )


# --------------------------------------------------------------------------- phases


def copy_times(device: torch.device, nbytes: int, *, repeats: int) -> list[float]:
    """Seconds of ``repeats`` copies of one random bfloat16 tensor of ``nbytes`` into another."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    copy = torch.empty_like(source)
    return [timed(device, lambda: copy.copy_(source)) for _ in range(repeats)]


def measure_copy_bandwidth(device: torch.device, sizes: Sizes) -> Row:
    """Bytes read plus bytes written per second by a device-to-device copy, median of 10."""
    times = copy_times(device, sizes.copy_bytes, repeats=13)[3:]
    release_memory(device)
    seconds = statistics.median(times)
    rate = 2 * sizes.copy_bytes / seconds
    return Row(
        "bandwidth",
        "device-to-device copy",
        "ok",
        fmt_count(rate, "B/s"),
        f"{sizes.copy_bytes / 2**30:.3g} GiB copied in {fmt_ms(seconds)}, median of 10 after "
        "3 warm-ups; bytes read + written",
        {"bytes_per_second": rate, "copy_bytes": sizes.copy_bytes, "seconds": seconds},
    )


def load_config(name: str, *, shapes: str):
    """The shipped config of model ``name`` (``MODELS``): as it is (``real``), narrowed
    (``rehearsal``: :data:`REHEARSAL_WIDTH_DIVISOR`) or shrunk (``tiny``: :data:`TINY_SHAPE`)."""
    from transformers import AutoConfig

    path = CONFIGS / MODELS[name]
    if shapes == "tiny":
        return AutoConfig.from_pretrained(path, **TINY_SHAPE)
    if shapes == "rehearsal":
        real = AutoConfig.from_pretrained(path)
        narrowed = {
            key: getattr(real, key) // REHEARSAL_WIDTH_DIVISOR
            for key in ("hidden_size", "intermediate_size")
        }
        return AutoConfig.from_pretrained(path, **narrowed)
    return AutoConfig.from_pretrained(path)


def build_model(config, *, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A random-weight causal LM of ``config``, created on ``device`` in ``dtype`` (transformers'
    own initialisation: normal weights of std ``initializer_range``, unit norms) from
    ``seed`` (models of one shape, as in the tiny form, differ by their seeds)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def bytes_per_token(model: torch.nn.Module, context: int) -> tuple[int, int]:
    """What a one-token forward reads: the weights (all but the input embedding table, of
    which it reads one row, unless the table is also the output head) and the KV cache of
    ``context`` positions. ``-> (weight bytes, KV bytes)``."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        weights -= embedding.numel() * embedding.element_size()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_key_value_heads * head_dim * embedding.element_size()
    return weights, config.num_hidden_layers * per_position * context


def model_row(name: str, model: torch.nn.Module, context: int, seconds: float) -> Row:
    """The model built: its size, what a one-token forward reads, and finite logits."""
    prompt = torch.randint(model.config.vocab_size, (8,), generator=torch.Generator()).tolist()
    logits = CachedLM(model, forward_path="lean").logits(prompt, 1)
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("the random weights give non-finite logits")
    weights, kv = bytes_per_token(model, context)
    parameters = sum(p.numel() for p in model.parameters())
    config = model.config
    return Row(
        "model",
        f"{name} ({MODELS[name]})",
        "ok",
        f"{fmt_count(parameters, 'parameters')}, {fmt_count(weights, 'B')} read per token",
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}; KV cache of {context} positions {fmt_count(kv, 'B')}; built in "
        f"{seconds:.1f} s; logits finite",
        {"parameters": parameters, "weight_bytes": weights, "kv_bytes": kv, "build_s": seconds},
    )


def forward_cost_row(name: str, model: torch.nn.Module, sizes: Sizes, *, draft: bool) -> Row:
    """``V(n)`` for n = 1..16 (a target) or ``d``, the one-token forward (the draft)."""
    device = next(model.parameters()).device
    costs = measure_forward_cost(
        model,
        max_new_tokens=1 if draft else MAX_NEW_TOKENS,
        context_tokens=sizes.context,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
        clock=device_clock(device),
    )
    values = {"median_ms": {c.new_tokens: c.median_ms for c in costs}}
    values["ratio"] = {c.new_tokens: c.ratio for c in costs}
    one = costs[0].median_ms / 1000
    after = f"after {sizes.context} cached, median of {sizes.repeats}"
    if draft:
        return Row("forward cost", f"draft {name}: d", "ok", fmt_ms(one), after, values)
    ratios = " ".join(f"{c.ratio:.2f}" for c in costs)
    return Row(
        "forward cost",
        f"target {name}: V(n)",
        "ok",
        f"V(1) {fmt_ms(one)}, V(16)/V(1) {costs[-1].ratio:.2f}",
        f"V(n)/V(1) for n = 1..16: {ratios}; {after}",
        values,
    )


def engine_row(
    name: str,
    model: torch.nn.Module,
    sizes: Sizes,
    bandwidth: float | None,
    *,
    role: str,
    forward_path: str = "lean",
) -> Row:
    """A model decoding alone through flyspec's decoder (mode target, greedy): its time per
    token against the bound, split into the forwards' device time and the loop's."""
    device = next(model.parameters()).device
    lm, runner = timed_lm(model, forward_path)
    decoder = SpeculativeDecoder(lm)
    prompt = random_prompt(model.config.vocab_size, sizes.context)
    decode_window(decoder, [runner], prompt, DecodeConfig(mode="target", max_new_tokens=8))
    config = DecodeConfig(mode="target", max_new_tokens=sizes.engine_tokens)
    window = decode_window(decoder, [runner], prompt, config)
    syncs = None
    if device.type == "cuda":
        counted = decode_window(
            decoder,
            [runner],
            prompt,
            DecodeConfig(mode="target", max_new_tokens=sizes.sync_tokens),
            count_syncs=True,
        )
        syncs = None if counted.syncs is None else counted.syncs / counted.tokens
    per_token = window.seconds / window.tokens
    forwards = window.forward_seconds / window.tokens
    weights, kv = bytes_per_token(model, sizes.context)
    values = {
        "ms_per_token": 1000 * per_token,
        "forward_ms_per_token": 1000 * forwards,
        "loop_ms_per_token": 1000 * (per_token - forwards),
        "syncs_per_token": syncs,
        "tokens": window.tokens,
        "token_ids": list(window.token_ids),
    }
    bound = ""
    if bandwidth:
        values["bound_ms"] = 1000 * (weights + kv) / bandwidth
        values["engine_over_bound"] = per_token / ((weights + kv) / bandwidth)
        bound = (
            f"; bound {fmt_ms((weights + kv) / bandwidth)}, "
            f"engine/bound {values['engine_over_bound']:.2f}"
        )
    return Row(
        "engine alone",
        f"{role} {name}, mode target{compiled_suffix(forward_path)}",
        "ok",
        f"{fmt_ms(per_token)} per token{bound}",
        f"forwards {fmt_ms(forwards)} (device time), loop {fmt_ms(per_token - forwards)} per "
        f"token; host syncs per token: {sync_text(device, syncs)}; {window.tokens} tokens "
        "after the first",
        values,
    )


def compiled_suffix(forward_path: str) -> str:
    return ", compiled" if forward_path == "compiled" else ""


def compiled_row(
    measure: Callable[[], Row], eager: Row | None, key: str, *, device: torch.device
) -> Row:
    """``measure``'s row, made on the compiled forward (``torch.compile``; CUDA graphs on a
    GPU), with the compile time (the first, untimed run of the row's work pays it), the
    graphs compiled and, on CUDA, the compiled graphs inductor ran without a CUDA graph (it
    says why in its log), and the figure ``key`` against the eager row of the same run."""
    from torch._dynamo.utils import counters

    def counts() -> tuple[int, int]:
        return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]

    before = counts()
    started = time.perf_counter()
    row = replace(measure(), phase="compiled")
    row.values["seconds_with_compiling"] = time.perf_counter() - started
    graphs, skips = (after - then for after, then in zip(counts(), before, strict=True))
    row.values["graphs_compiled"] = graphs
    row.detail += f"; graphs compiled: {graphs}"
    if device.type == "cuda":
        row.values["cuda_graphs_skipped"] = skips
        row.detail += f", run without a CUDA graph: {skips}"
    row.detail += f"; the row took {row.values['seconds_with_compiling']:.0f} s with compiling"
    if eager is not None and eager.status == "ok" and key in eager.values:
        ratio = row.values[key] / eager.values[key]
        row.values[f"{key}_compiled_over_eager"] = ratio
        row.result += f"; compiled/eager {ratio:.2f}"
        row.detail += "; " + same_as_eager(row.values, eager.values["token_ids"])
    return row


def same_as_eager(values: dict[str, Any], eager_ids: Sequence[int]) -> str:
    """How many of the compiled decode's tokens (``values["token_ids"]``) are the eager one's,
    recorded in ``values``: information, not a failure, as compiling reorders the arithmetic
    (in bfloat16 a near tie can flip)."""
    ids = values["token_ids"]
    same = values["same_as_eager"] = common_prefix_length(ids, eager_ids)
    if list(ids) == list(eager_ids):
        return f"the same {len(eager_ids)} tokens as eager"
    return f"the eager decode's tokens up to token {same + 1} of {len(eager_ids)}"


def sync_text(device: torch.device, syncs: float | None) -> str:
    if syncs is not None:
        return f"{syncs:.1f}"
    return "not counted on the CPU" if device.type != "cuda" else "not reported by torch"


def overhead_row(
    name: str, model: torch.nn.Module, sizes: Sizes, k: int, *, forward_path: str = "lean"
) -> Row:
    """The target drafting for itself with FLy at block size ``k``: the loop's own time per
    round beyond its forwards, and its host synchronisations."""
    device = next(model.parameters()).device
    target_lm, target_runner = timed_lm(model, forward_path)
    draft_lm, draft_runner = timed_lm(model, forward_path)
    decoder = SpeculativeDecoder(target_lm, draft_lm)
    runners = [target_runner, draft_runner]
    prompt = random_prompt(model.config.vocab_size, sizes.context)
    decode_window(decoder, runners, prompt, DecodeConfig(mode="fly", k=k, max_new_tokens=2 * k + 4))
    config = DecodeConfig(mode="fly", k=k, max_new_tokens=sizes.overhead_tokens)
    window = decode_window(decoder, runners, prompt, config)
    syncs = None
    if device.type == "cuda":
        counted = decode_window(
            decoder,
            runners,
            prompt,
            config.with_updates(max_new_tokens=max(sizes.sync_tokens, 3 * (k + 1))),
            count_syncs=True,
        )
        syncs = None if counted.syncs is None else counted.syncs / counted.rounds
    round_s = window.seconds / window.rounds
    forwards = window.forward_seconds / window.rounds
    values = {
        "k": k,
        "overhead_ms_per_round": 1000 * (round_s - forwards),
        "round_ms": 1000 * round_s,
        "forward_ms_per_round": 1000 * forwards,
        "tokens_per_round": window.tokens / window.rounds,
        "drafted_per_round": window.drafted / window.rounds,
        "kept_fraction": window.kept / window.drafted if window.drafted else None,
        "syncs_per_round": syncs,
        "rounds": window.rounds,
        "token_ids": list(window.token_ids),
    }
    return Row(
        "loop overhead",
        f"target {name} drafting for itself, FLy K={k}{compiled_suffix(forward_path)}",
        "ok",
        f"{fmt_ms(round_s - forwards)} per round beyond the forwards",
        f"round {fmt_ms(round_s)}, forwards {fmt_ms(forwards)} (device time); "
        f"{window.tokens / window.rounds:.2f} tokens per round, "
        f"{window.kept}/{window.drafted} drafted kept; host syncs per round: "
        f"{sync_text(device, syncs)}; "
        f"{window.rounds} rounds after the first",
        values,
    )


@dataclass(frozen=True)
class SameTokensCase:
    """A decode to compare with the target alone. ``draft``: the draft model drafts
    (``"draft"``), the target drafts for itself (``"self"``), or no model drafts (None);
    ``prediction``: the target's own answer is given as the request's prediction;
    ``lossless``: exact verification, which must give the target's tokens (else the decode
    only has to run: FLy keeps loose tokens, a sampled one draws); ``forward_path``: the
    models' forward (the reference is the target alone's on the same forward)."""

    subject: str
    config: DecodeConfig
    draft: str | None = "draft"
    prediction: bool = False
    lossless: bool = True
    forward_path: str = "lean"


def same_tokens_cases(k: int) -> list[SameTokensCase]:
    """Each drafter and rule of the engine once: exact SPD (lossless) with the draft model,
    the target drafting for itself (every block kept), n-gram drafting and a prediction;
    FLy with the draft model, MLA, -k auto and sampling."""
    exact, fly = DecodeConfig(mode="spd", k=k), DecodeConfig(mode="fly", k=k)
    sampled = SamplingConfig(temperature=0.8, seed=0)
    return [
        SameTokensCase(f"spd K={k}, the draft model drafting", exact),
        SameTokensCase(f"spd K={k}, the target drafting for itself", exact, draft="self"),
        SameTokensCase(
            f"spd K={k}, n-gram drafting", exact.with_updates(drafter="ngram"), draft=None
        ),
        SameTokensCase(
            f"spd K={k}, the target's own answer as the prediction", exact, prediction=True
        ),
        SameTokensCase(f"fly K={k}, the draft model drafting", fly, lossless=False),
        SameTokensCase(f"fly K={k}, MLA drafting", fly.with_updates(drafter="mla"), lossless=False),
        SameTokensCase(f"fly -k auto, K up to {k}", fly.with_updates(auto_k=True), lossless=False),
        SameTokensCase(
            f"fly K={k}, sampled at T=0.8", fly.with_updates(sampling=sampled), lossless=False
        ),
    ]


def compiled_same_tokens_cases(k: int) -> list[SameTokensCase]:
    """The lossless cases on the compiled forward, against the compiled target alone: exact
    SPD with the draft model and with the target's answer as the prediction."""
    exact = DecodeConfig(mode="spd", k=k)
    return [
        SameTokensCase(
            f"spd K={k}, the draft model drafting, compiled", exact, forward_path="compiled"
        ),
        SameTokensCase(
            f"spd K={k}, the target's own answer as the prediction, compiled",
            exact,
            prediction=True,
            forward_path="compiled",
        ),
    ]


def same_tokens_row(
    case: SameTokensCase,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt: list[int],
    reference: list[int],
) -> Row:
    """``case`` decoded on the device, its tokens against ``reference``, the target's greedy
    answer to ``prompt``; where an exact decode differs, the target's margin between its two
    most likely tokens there (a near tie can flip between forwards of different sizes)."""
    drafting = {"draft": draft, "self": target, None: None}[case.draft]
    decoder = SpeculativeDecoder(target, drafting, forward_path=case.forward_path)
    stats = RequestStats()
    config = case.config.with_updates(max_new_tokens=len(reference))
    events = decoder.stream(
        prompt, config, stats=stats, prediction=reference if case.prediction else None
    )
    tokens = [event.token for event in events]
    same = common_prefix_length(tokens, reference)
    differs = None if tokens == reference else same
    values = {
        "tokens": len(tokens),
        "same_as_target": same,
        "rounds": stats.num_rounds,
        "tau": stats.tau,
        "drafted": stats.drafted,
        "kept_exactly": stats.accepted,
        "kept_loosely": stats.loosely_accepted,
    }
    detail = (
        f"{stats.num_rounds} rounds, tau {stats.tau:.2f}; of {stats.drafted} drafted, "
        f"{stats.accepted} kept exactly, {stats.loosely_accepted} loosely"
    )
    if not case.lossless:
        result = f"ran: {len(tokens)} tokens, the first {same} as the greedy target's"
        return Row("same tokens", case.subject, "ok", result, detail, values)
    if differs is None:
        result = f"{same}/{len(reference)} tokens as the target alone"
        return Row("same tokens", case.subject, "ok", result, detail, values)
    margin = values["target_top2_margin"] = top2_margin(target, prompt + reference[:differs])
    return Row(
        "same tokens",
        case.subject,
        "failed",
        f"differs from the target alone at token {differs + 1} of {len(reference)}",
        f"{detail}; the target's top-2 logit margin there {margin:.2g}",
        values,
    )


def top2_margin(target: torch.nn.Module, tokens: list[int]) -> float:
    """The eager target's margin between its two most likely next tokens after ``tokens``."""
    logits = CachedLM(target, forward_path="lean").logits(tokens, 1)[0]
    top = logits.float().topk(2).values.tolist()
    return top[0] - top[1]


def compiled_against_eager_row(
    target: torch.nn.Module, prompt: list[int], reference: list[int], compiled: list[int]
) -> Row:
    """The target alone on the compiled forward against the eager ``reference`` (float32):
    the same tokens, or a first difference at a near tie (:data:`NEAR_TIE`) that rounding
    can flip; a difference where the target was sure fails. ``compiled`` receives the
    compiled decode's tokens (the compiled cases' reference)."""
    decoder = SpeculativeDecoder(target, forward_path="compiled")
    config = DecodeConfig(mode="target", max_new_tokens=len(reference))
    compiled.extend(event.token for event in decoder.stream(prompt, config))
    checks = getattr(decoder.target.runner, "compile_checks", {})
    values = {"tokens": len(compiled), "token_ids": list(compiled), "compile_checks": checks}
    detail = "first forwards against eager (largest logit difference over the largest logit): "
    detail += ", ".join(f"{kind} {value:.2g}" for kind, value in checks.items()) or "none"
    same = values["same_as_eager"] = common_prefix_length(compiled, reference)
    if compiled == reference:
        return Row(
            "same tokens",
            "the target alone, compiled, against eager",
            "ok",
            f"{same}/{len(reference)} tokens as eager",
            detail,
            values,
        )
    margin = values["eager_top2_margin"] = top2_margin(target, prompt + reference[:same])
    near_tie = margin < NEAR_TIE
    return Row(
        "same tokens",
        "the target alone, compiled, against eager",
        "ok" if near_tie else "failed",
        f"differs from eager at token {same + 1} of {len(reference)}"
        + (", a near tie" if near_tie else ""),
        f"{detail}; the eager target's top-2 logit margin there {margin:.2g}",
        values,
    )


def random_prompt(vocab_size: int, length: int, *, seed: int = 1) -> list[int]:
    """Token ids of a prompt (the costs do not depend on them)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (length,), generator=generator).tolist()


def load_tau() -> list[dict]:
    """The tau figures of ``measured_tau.json``, each with its source."""
    runs = json.loads(TAU_FILE.read_text())["runs"]
    return [{**entry, "source": run["source"]} for run in runs for entry in run["tau"]]


def projection_rows(
    name: str,
    target_costs: dict[int, float],
    draft_ms: float,
    *,
    engine_ms: float | None,
    overhead_ms: dict[int, float],
) -> list[Row]:
    """FLy's and SPD's projected speedup on target ``name``: ``benchmarks/break_even.py``'s
    round cost (``K * d + V(K+1)`` for tau tokens, against ``V(1)`` a token) from the measured
    forwards; then with the engine's time per target token and the loop's overhead per round."""
    break_even = load_script("break_even")
    rows = []
    for entry in load_tau():
        method, k, tau = entry["method"], entry["k"], entry["tau"]
        commit = entry["source"]["commit"]
        subject = f"{method} K={k} on the {name} target (tau {tau} from {commit})"
        if k + 1 not in target_costs:
            rows.append(Row("projection", subject, "skipped", f"no V({k + 1}) measured"))
            continue
        bench = {"methods": [{"method": f"{method}@{k}", "tau": tau, "settings": {"k": k}}]}
        (costed,) = break_even.break_even_rows(bench, {"torch": (target_costs, draft_ms)})
        forwards_only = tau / (k * costed["draft_to_target"] + costed["measured_ratio"])
        values = {**costed, "speedup_forwards_only": forwards_only, "source": entry["source"]}
        result = f"{forwards_only:.2f}x from the forwards"
        if engine_ms is not None and k in overhead_ms:
            round_ms = k * draft_ms + target_costs[k + 1] + overhead_ms[k]
            values["speedup_with_loop"] = tau * engine_ms / round_ms
            result += f", {values['speedup_with_loop']:.2f}x with the loop"
        assumed = "" if name == "1.5b" else "; assumes the 0.5B drafts as well for this target"
        rows.append(
            Row(
                "projection",
                subject,
                "ok",
                result,
                f"PROJECTED, not measured: d/V(1) {costed['draft_to_target']:.2f}, "
                f"V({k + 1})/V(1) {costed['measured_ratio']:.2f}, "
                f"{break_even_text(k, tau, costed['draft_to_target'])}; tau of the default "
                f"pair on a CPU{assumed}",
                values,
            )
        )
    return rows


def break_even_text(k: int, tau: float, draft_to_target: float) -> str:
    """Where a round of ``k`` drafts committing ``tau`` tokens breaks even
    (``V(K+1)/V(1) <= tau - K * d/V(1)``), or why it cannot: a verify forward costs at least
    a one-token one, so a bound under 1 is out of reach."""
    needed = tau - k * draft_to_target
    if needed >= 1:
        return f"breaks even at V({k + 1})/V(1) <= {needed:.2f}"
    return (
        f"cannot break even: its {k} drafts cost {k * draft_to_target:.2f} V(1) and the verify "
        f"at least V(1), for {tau} tokens"
    )


def kernel_row(
    device: torch.device, sizes: Sizes, batches: int | None, *, kernels: Path = KERNELS
) -> Row:
    """vLLM 0.34's FLy kernel on random conformance batches (benchmarks/vllm_fly_gpu.py), from
    the files extracted into ``kernels``."""
    subject = "vLLM 0.34 rejection_sample (FLy) against flyspec's rule"
    if not (kernels / "vllm" / "__init__.py").exists():
        return Row("kernel check", subject, "skipped", "kernels not extracted")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return Row("kernel check", subject, "skipped", "on the CPU it needs TRITON_INTERPRET=1")
    script = load_script("vllm_fly_gpu")
    args = argparse.Namespace(
        kernels=kernels,
        device=str(device),
        batches=batches or sizes.kernel_batches,
        vocab_size=sizes.kernel_vocab,
        requests=None,
        max_drafted=8,
        seed=0,
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            code = script.run(args)
        except SystemExit as stop:  # its refusals (no kernels, vllm imported first) exit
            raise RuntimeError(str(stop.code)) from None
    lines = printed.getvalue().strip().splitlines()
    for line in lines:
        log(f"kernel check: {line}")
    summary = next((line for line in lines if line.startswith("vLLM")), "")
    mismatches = lines[-1] if lines else "no output"
    return Row(
        "kernel check",
        subject,
        "ok" if code == 0 else "failed",
        mismatches,
        summary,
        {"exit_code": code, "output": lines[-22:]},
    )


def load_replay_traces() -> dict[tuple[str, str], Trace]:
    """Every recorded trace, by its set (``benchmarks/traces/<set>.json``) and name."""
    traces = {}
    for path in sorted(TRACES.glob("*.json")):
        _, recorded = load_traces(path)
        traces.update({(path.stem, trace.name): trace for trace in recorded})
    return traces


def replay_rows(
    name: str,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    wanted: Sequence[tuple[str, Trace]],
    *,
    requests: int | None,
) -> list[Row]:
    """Each trace of ``wanted`` replayed (:class:`~flyspec.bench.replay.ReplayDecoder`) on
    ``target`` with ``draft`` drafting, both compiled, on random prompts of the traced lengths:
    its decoding speed against the compiled target alone on the same prompts and tokens, a
    round of each trace first, untimed (it compiles)."""
    vocab = target.config.vocab_size
    alone = SpeculativeDecoder(target, forward_path="compiled")
    replaying = ReplayDecoder(target, draft, forward_path="compiled")
    rows = []
    for set_name, trace in wanted:
        chosen = trace.requests[:requests]
        prompts = [random_prompt(vocab, r.prompt_tokens, seed=i) for i, r in enumerate(chosen)]
        references, baseline = [], [0.0, 0]
        for prompt, request in zip(prompts, chosen, strict=True):
            stats = RequestStats()
            config = DecodeConfig(mode="target", max_new_tokens=request.tokens)
            run = after_first_round(alone.stream(prompt, config, stats=stats), stats)
            references.append(list(run.token_ids))
            baseline = [baseline[0] + run.seconds, baseline[1] + run.tokens]
        config = DecodeConfig(mode=trace.mode, drafter=trace.drafter)
        paying = replaying.paying_drafters(trace, config)
        warm = chosen[0]
        list(replaying.replay(prompts[0], warm, references[0], config, paying=paying))
        replaying.counts.agreed = replaying.counts.overruled = 0
        timed = [0.0, 0]
        for prompt, request, reference in zip(prompts, chosen, references, strict=True):
            stats = RequestStats()
            events = replaying.replay(
                prompt, request, reference, config, paying=paying, stats=stats
            )
            run = after_first_round(events, stats)
            timed = [timed[0] + run.seconds, timed[1] + run.tokens]
        alone_speed, replay_speed = baseline[1] / baseline[0], timed[1] / timed[0]
        sources = sorted({r.source for q in chosen for r in q.rounds if r.source})
        counts = replaying.counts
        rows.append(
            Row(
                "replay",
                f"{trace.name} ({set_name}) on the {name} target, compiled",
                "ok",
                f"{replay_speed / alone_speed:.2f}x over the compiled target alone, measured at "
                f"the real pair's recorded acceptance (tau {trace.tau:.2f})",
                f"{replay_speed:.1f} against {alone_speed:.1f} tokens/s decoding (after each "
                f"request's first round), {len(chosen)} requests of the trace, drafted by "
                f"{', '.join(sources)}; the target's own verdict agreed in {counts.agreed} "
                f"rounds, was overruled by the trace in {counts.overruled}",
                {
                    "speedup": replay_speed / alone_speed,
                    "tokens_per_second": replay_speed,
                    "alone_tokens_per_second": alone_speed,
                    "trace_tau": trace.tau,
                    "requests": len(chosen),
                    "agreed": counts.agreed,
                    "overruled": counts.overruled,
                },
            )
        )
    return rows


def compiled_cost_row(name: str, model: torch.nn.Module, sizes: Sizes) -> Row:
    """``V(n)`` on the compiled forward at its sizes (:data:`COMPILED_SIZES`: on CUDA every
    block runs at one of them), up to a prediction's block of 64 and the token before it."""
    device = next(model.parameters()).device
    times = time_forwards(
        model,
        new_tokens=COMPILED_SIZES,
        forward_paths=("compiled",),
        context_tokens=sizes.context,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
        clock=device_clock(device),
    )["compiled"]
    median = {n: statistics.median(samples) for n, samples in times.items()}
    ratios = {n: median[n] / median[1] for n in median}
    return Row(
        "compiled",
        f"target {name}: V(n), compiled",
        "ok",
        f"V(1) {fmt_ms(median[1])}, V(16)/V(1) {ratios[16]:.2f}, V(65)/V(1) {ratios[65]:.2f}",
        "V(n)/V(1) for n = "
        + ", ".join(f"{n}: {r:.2f}" for n, r in ratios.items())
        + f"; after {sizes.context} cached, median of {sizes.repeats}",
        {"median_ms": {n: 1000 * m for n, m in median.items()}, "ratio": ratios},
    )


ATTENTION_NEW_TOKENS = (1, 16, 65)
"""The compiled forward's sizes whose attention kernels the ``attention`` phase times: one
token, a block of 15 and the token before it, a prediction's block of 64 and the one before."""
ATTENTION_BUDGET = 512
"""The tokens a request may generate after the context, in the ``attention`` phase: the
buffer a request reserves holds the context, these and the largest block."""


def attention_row(name: str, model: torch.nn.Module, sizes: Sizes) -> Row:
    """Which attention kernel runs at the compiled forward's shapes, and what each kernel
    costs there: ``scaled_dot_product_attention`` as the forward calls it (the queries of n
    new tokens over the whole reserved buffer, a bool mask, grouped-query heads), the kernel
    torch's dispatch chooses for it, and each kernel forced in turn (those that refuse the
    shape say so); next to them, the same attention over the live positions alone with no
    mask, what a kernel that reads only the live length would cost."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    live = sizes.context
    capacity = live + ATTENTION_BUDGET + max(ATTENTION_NEW_TOKENS)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def median_ms(work: Callable[[], object]) -> float:
        for _ in range(sizes.warmup):
            work()
        return 1000 * statistics.median(timed(device, work) for _ in range(sizes.repeats))

    keys, values = randn(1, kv_heads, capacity, head_dim), randn(1, kv_heads, capacity, head_dim)
    backends = {
        "math": SDPBackend.MATH,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    per_size: dict[int, dict[str, Any]] = {}
    for n in ATTENTION_NEW_TOKENS:
        queries = randn(1, heads, n, head_dim)
        positions = torch.arange(live, live + n, device=device)
        mask = torch.arange(capacity, device=device) <= positions[:, None]  # [n, capacity]
        arguments = {"attn_mask": mask, "scale": head_dim**-0.5, "enable_gqa": heads != kv_heads}
        attention = torch.nn.functional.scaled_dot_product_attention
        attend = functools.partial(attention, queries, keys, values, **arguments)

        timings: dict[str, Any] = {}
        try:
            choice = torch._fused_sdp_choice(
                queries,
                keys,
                values,
                mask,
                0.0,
                False,
                scale=arguments["scale"],
                enable_gqa=arguments["enable_gqa"],
            )
            timings["chosen"] = SDPBackend(choice).name.lower().replace("_attention", "")
        except Exception as error:  # noqa: BLE001 - a private function: say what it said
            timings["chosen"] = f"unknown ({error_line(error, limit=80)})"
        timings["default_ms"] = median_ms(attend)
        for label, backend in backends.items():
            try:
                with sdpa_kernel(backend):
                    timings[f"{label}_ms"] = median_ms(attend)
            except RuntimeError as error:
                timings[f"{label}_ms"] = None
                timings[f"{label}_refused"] = error_line(error, limit=80)
        live_arguments = {**arguments, "attn_mask": None if n == 1 else mask[:, : live + n]}
        attend_live = functools.partial(
            attention, queries, keys[:, :, : live + n], values[:, :, : live + n], **live_arguments
        )
        timings["live_length_ms"] = median_ms(attend_live)
        per_size[n] = timings

    def kernels(n: int) -> str:
        timings = per_size[n]
        forced = ", ".join(
            f"{label} {timings[f'{label}_ms']:.3f}"
            if timings[f"{label}_ms"] is not None
            else f"{label} refused"
            for label in backends
        )
        return f"n={n}: {forced}; live length only {timings['live_length_ms']:.3f} ms"

    result = "; ".join(
        f"n={n}: {t['chosen']} {t['default_ms']:.3f} ms" for n, t in per_size.items()
    )
    return Row(
        "attention",
        f"target {name}: SDPA at the compiled shapes",
        "ok",
        result,
        "forced, ms: "
        + " | ".join(kernels(n) for n in per_size)
        + f"; {heads} heads over {kv_heads}, head dim {head_dim}, {live} live positions of a "
        f"buffer of {capacity}, eager, median of {sizes.repeats}",
        {"live": live, "capacity": capacity, "sizes": per_size},
    )


def profile_row(name: str, model: torch.nn.Module, sizes: Sizes, *, tokens: int = 6) -> Row:
    """Where the eager forward's time goes, alone and inside the decoder: torch's profiler over
    ``tokens`` one-token forwards timed alone (as ``V(1)``) and over as many tokens of the
    decoder in mode target; per forward, the host's time, the kernels launched and the device's
    time, and the operators with the most host time in the decoder."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prompt = random_prompt(model.config.vocab_size, sizes.context)
    runner = make_forward(model, "lean")
    token = torch.tensor([[prompt[-1]]], device=device)
    decoder = SpeculativeDecoder(model, forward_path="lean")
    config = DecodeConfig(mode="target", max_new_tokens=tokens)
    with torch.inference_mode():
        runner.forward(torch.tensor([prompt], device=device), 1)
        for _ in range(2):  # warm-up
            runner.crop(len(prompt))
            runner.forward(token, 1)
    list(decoder.stream(prompt, config))

    def lone() -> None:
        with torch.inference_mode():
            for _ in range(tokens):
                runner.crop(len(prompt))
                runner.forward(token, 1)
        wait_for_device(device)

    def in_decoder() -> None:
        list(decoder.stream(prompt, config))
        wait_for_device(device)

    figures = {}
    for label, work in (("alone", lone), ("decoder", in_decoder)):
        with profile(activities=activities) as profiled:
            started = time.perf_counter()
            work()
            wall = time.perf_counter() - started
        events = profiled.key_averages()
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
        figures[label] = {
            "wall_ms_per_token": 1000 * wall / tokens,
            "launches_per_token": launches / tokens,
            "device_ms_per_token": device_us / 1000 / tokens,
            "top_host_ops": [
                (e.key, round(e.self_cpu_time_total / 1000 / tokens, 3))
                for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
            ],
        }
    alone, inside = figures["alone"], figures["decoder"]
    top = ", ".join(f"{op} {ms:.2g} ms" for op, ms in inside["top_host_ops"][:5])
    return Row(
        "profile",
        f"target {name}, eager: a forward alone and in the decoder",
        "ok",
        f"{fmt_ms(alone['wall_ms_per_token'] / 1000)} a token alone, "
        f"{fmt_ms(inside['wall_ms_per_token'] / 1000)} in the decoder (profiled)",
        f"kernel launches per token {alone['launches_per_token']:.0f} alone, "
        f"{inside['launches_per_token']:.0f} in the decoder; device time per token "
        f"{alone['device_ms_per_token']:.3g} ms and {inside['device_ms_per_token']:.3g} ms; "
        f"most host time in the decoder, per token: {top}",
        figures,
    )


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Compile:
    """One graph compiled by dynamo in a phase (one frame, fullgraph): its seconds, whether
    inductor found it in its cache (a warm compile), and why it failed (None: it did not)."""

    seconds: float
    cached: bool
    failure: str | None


@dataclass(frozen=True)
class PhaseCompiles:
    """The graphs a phase compiled, for the model ``model`` (the one the phase compiles
    first; None: a phase meant to compile nothing)."""

    model: str | None
    phase: str
    subject: str
    compiles: tuple[Compile, ...]


def compiles_since_cleared() -> tuple[Compile, ...]:
    """The graphs dynamo compiled since its metrics were last cleared."""
    from torch._dynamo.utils import get_compilation_metrics

    return tuple(
        Compile(
            seconds=m.entire_frame_compile_time_s or 0.0,
            cached=bool(m.inductor_fx_local_cache_hit_count)
            and not m.inductor_fx_local_cache_miss_count,
            failure=m.fail_type,
        )
        for m in get_compilation_metrics()
        if m.co_name  # a frame's compile (not a runtime record)
    )


class Table:
    """The rows being made, with the start time and the time limit of the run, and the
    graphs each phase compiled. After each phase, ``after_phase`` gets the rows so far (the
    run saves them: a run cut short keeps what it measured)."""

    def __init__(
        self, time_limit: float, after_phase: Callable[[list[Row]], None] | None = None
    ) -> None:
        self.time_limit = time_limit
        self.after_phase = after_phase
        self.started = time.perf_counter()
        self.rows: list[Row] = []
        self.compiles: list[PhaseCompiles] = []

    def phase(
        self,
        phase: str,
        subject: str,
        work: Callable[[], Row | list[Row]],
        *,
        needs: float = 0,
        compiles: str | None = None,
    ) -> list[Row]:
        """Run one phase and add its rows: a failure is a row with its reason, and a phase
        that would start past the time limit, or end past it by its expected ``needs``
        seconds, is skipped. The graphs it compiles are counted for the model ``compiles``,
        and its time is said and kept in its first row (``phase_s``)."""
        from torch._dynamo.utils import clear_compilation_metrics

        elapsed = time.perf_counter() - self.started
        if elapsed + needs > self.time_limit:
            reason = f"time limit of {self.time_limit:.0f} s"
            if needs:
                reason += f" (needs about {needs:.0f} s, {elapsed:.0f} s gone)"
            rows = [Row(phase, subject, "skipped", reason)]
        else:
            log(f"{phase}: {subject} ({elapsed:.0f} s)")
            clear_compilation_metrics()
            try:
                produced = work()
                rows = produced if isinstance(produced, list) else [produced]
            except PhaseSkipped as skipped:
                rows = [Row(phase, subject, "skipped", str(skipped))]
            except Exception as error:  # every failure is reported and the run goes on
                reason = error_line(error, limit=200)
                log(f"{phase}: {subject} FAILED: {reason}")
                rows = [Row(phase, subject, "failed", reason)]
            seconds = time.perf_counter() - self.started - elapsed
            compiled = compiles_since_cleared()
            self.compiles.append(PhaseCompiles(compiles, phase, subject, compiled))
            rows[0].values["phase_s"] = round(seconds, 2)
            said = f"{phase}: {subject} took {seconds:.1f} s"
            if compiled:
                each = ", ".join(f"{c.seconds:.1f}" for c in compiled)
                said += f", {len(compiled)} graphs compiled ({each} s)"
            log(said)
        self.rows.extend(rows)
        for row in rows:
            log(markdown([row]).splitlines()[-1])
        if self.after_phase is not None:
            self.after_phase(self.rows)
        return rows

    def value(self, rows: list[Row], key: str) -> Any:
        """``values[key]`` of the first ok row of ``rows`` that has it (None when none does)."""
        return next((r.values[key] for r in rows if r.status == "ok" and key in r.values), None)


def environment(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """Where and how the figures were made."""
    import transformers

    described = platform.processor() or platform.machine()
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        described = (
            f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
            f"compute capability {properties.major}.{properties.minor}, CUDA {torch.version.cuda}"
        )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_description": described,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "tiny": args.tiny,
        "shapes": shapes_of(args),
        "cpu_threads": torch.get_num_threads(),
        "targets": args.targets,
    }


class FirstLook:
    """The phases in order: the copy bandwidth, the draft, then each target built, measured
    and let go before the next (the 32B target alone holds about 65 GB), the projections, and
    the kernel check."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --device cpu (with --rehearse or --tiny)")
        self.dtype = resolve_dtype(args.dtype, self.device, rehearse=args.rehearse)
        if self.device.type == "cpu":
            torch.set_num_threads(args.threads)
        self.shapes = shapes_of(args)
        self.sizes = FULL if self.shapes == "real" else TINY
        self.targets = parse_targets(args.targets)
        if args.quick:
            self.targets.sort(key=QUICK_ORDER.index)
        real = self.shapes == "real"
        if self.device.type == "cpu" and real and {"7b", "32b"} & set(self.targets):
            raise SystemExit(
                "the 7B and 32B shapes need a GPU: pass --rehearse (or --tiny) on the CPU"
            )
        self.env = environment(self.device, self.dtype, args)
        self.folders = output_folders(args)
        self.table = Table(args.time_limit, after_phase=self.save)
        self.ks = sorted(set(OVERHEAD_KS) | {entry["k"] for entry in load_tau()})
        self.bandwidth: float | None = None
        self.draft_ms: float | None = None
        self.eager: dict[tuple[str, str | int], Row] = {}  # rows to compare compiled ones with
        self.draft_compiled = False  # whether a phase has compiled the draft's forward yet

    def run(self) -> tuple[dict, list[Row]]:
        env = self.env
        self.table.rows.append(
            Row("device", env["device"], "ok", env["device_description"], describe(env), env)
        )
        rows = self.table.phase(
            "bandwidth",
            "device-to-device copy",
            lambda: measure_copy_bandwidth(self.device, self.sizes),
        )
        self.bandwidth = self.table.value(rows, "bytes_per_second")
        if not self.args.quick:
            self.check_same_tokens()
            release_memory(self.device)
            self.measure_draft()
            for name in self.targets:
                self.measure_target(name)
                release_memory(self.device)
            self.table.phase(
                "kernel check",
                "vLLM 0.34 FLy kernel",
                lambda: kernel_row(self.device, self.sizes, self.args.kernel_batches),
            )
        draft = self.build(DRAFT)
        for index, name in enumerate(self.targets):
            self.measure_compiled(name, draft, loop=index == 0)
            release_memory(self.device)
        if self.args.quick:  # after the targets: the largest ones' goals come first
            del draft
            release_memory(self.device)
            self.check_same_tokens()
        self.table.rows.extend(compile_rows(self.table.compiles, shapes=self.shapes))
        self.table.rows.extend(goal_rows(self.table.rows, on_cuda=self.device.type == "cuda"))
        env["elapsed_s"] = round(time.perf_counter() - self.table.started, 1)
        env["complete"] = True
        return env, self.table.rows

    def label(self, name: str, dtype: torch.dtype | None = None) -> str:
        """How the compile rows name model ``name`` in ``dtype`` (default: the run's)."""
        return f"{name} {str(dtype or self.dtype).removeprefix('torch.')}"

    def compile_needs(self, name: str) -> float:
        """The seconds a phase that compiles model ``name`` is given before the time limit
        (:data:`COMPILE_BUDGET_S`; none on the CPU's shapes, which have no time limit)."""
        return COMPILE_BUDGET_S[name] if self.shapes == "real" else 0

    def build(self, name: str, dtype: torch.dtype | None = None) -> torch.nn.Module | None:
        """Model ``name`` on the device, in ``dtype`` (default: the run's), or None (its row
        says why)."""
        built: list[torch.nn.Module] = []
        dtype = dtype or self.dtype

        def work() -> Row:
            started = time.perf_counter()
            config = load_config(name, shapes=self.shapes)
            seed = list(MODELS).index(name)
            built.append(build_model(config, device=self.device, dtype=dtype, seed=seed))
            wait_for_device(self.device)
            return model_row(name, built[0], self.sizes.context, time.perf_counter() - started)

        subject = f"{name} ({MODELS[name]})"
        if dtype != self.dtype:
            subject += f", {str(dtype).removeprefix('torch.')}"
        if self.table.phase("model", subject, work)[0].status != "ok":
            built.clear()
            release_memory(self.device)
        return built[0] if built else None

    def measured(
        self, model: torch.nn.Module | None, work: Callable[[torch.nn.Module], Row]
    ) -> Callable[[], Row]:
        """``work`` on ``model``, skipped when the model could not be built."""

        def guarded() -> Row:
            if model is None:
                raise PhaseSkipped("the model was not built")
            return work(model)

        return guarded

    def save(self, rows: list[Row]) -> None:
        """Write the rows so far, marked partial until the run has ended."""
        elapsed = round(time.perf_counter() - self.table.started, 1)
        env = {**self.env, "elapsed_s": elapsed, "complete": False}
        for folder in self.folders:
            write_outputs(folder, env, rows)

    def check_same_tokens(self) -> None:
        """Every drafter and rule on the device, in float32 (where forwards of different
        sizes agree closely enough that exact decoding must give the target's tokens): the
        draft and the :data:`SAME_TOKENS_TARGET` target, a prompt that repeats itself (so that
        n-gram drafting and MLA find matches), each case of :func:`same_tokens_cases` against
        the target alone."""
        draft = self.build(DRAFT, dtype=torch.float32)
        target = self.build(SAME_TOKENS_TARGET, dtype=torch.float32)
        reference: list[int] = []
        prompt = [] if target is None else random_prompt(target.config.vocab_size, 16) * 4

        compiled: list[int] = []

        def greedy() -> Row:
            if draft is None or target is None:
                raise PhaseSkipped("the models were not built")
            decoder = SpeculativeDecoder(target, forward_path="lean")
            config = DecodeConfig(mode="target", max_new_tokens=self.sizes.same_tokens)
            reference.extend(event.token for event in decoder.stream(prompt, config))
            result = f"{len(reference)} tokens after a prompt of {len(prompt)}"
            return Row("same tokens", "the target alone, greedy", "ok", result)

        def case_row(case: SameTokensCase, tokens: list[int]) -> Callable[[], Row]:
            def work() -> Row:
                if not tokens:
                    raise PhaseSkipped("no answer of the target alone to compare with")
                return same_tokens_row(case, target, draft, prompt, tokens)

            return work

        def against_eager() -> Row:
            if not reference:
                raise PhaseSkipped("no answer of the eager target alone to compare with")
            return compiled_against_eager_row(target, prompt, reference, compiled)

        self.table.phase("same tokens", "the target alone, greedy", greedy)
        cases = same_tokens_cases(SAME_TOKENS_K)
        for case in cases if not self.args.quick else [c for c in cases if c.lossless]:
            self.table.phase("same tokens", case.subject, case_row(case, reference))
        float32 = torch.float32
        self.table.phase(
            "same tokens",
            "the target alone, compiled, against eager",
            against_eager,
            needs=self.compile_needs(SAME_TOKENS_TARGET),
            compiles=self.label(SAME_TOKENS_TARGET, float32),
        )
        for case in compiled_same_tokens_cases(SAME_TOKENS_K):
            self.table.phase(
                "same tokens",
                case.subject,
                case_row(case, compiled),
                needs=self.compile_needs(DRAFT) if case.draft == "draft" else 0,
                compiles=self.label(DRAFT, float32) if case.draft == "draft" else None,
            )

    def measure_compiled(self, name: str, draft: torch.nn.Module | None, *, loop: bool) -> None:
        """The target ``name`` on the compiled forward: alone (against the eager row of the
        run, where there is one), its ``V(n)`` up to 65 tokens, with ``loop`` drafting for
        itself at K=:data:`COMPILED_K` (the loop's own time and host synchronisations per
        round), and the traces of :data:`REPLAYS` replayed with ``draft`` drafting. Last, as
        compiling takes the longest."""
        model = self.build(name)
        sizes, bandwidth, device = self.sizes, self.bandwidth, self.device
        label = self.label(name)
        replayed = bool((QUICK_REPLAYS if self.args.quick else REPLAYS).get(name))
        draft_first = replayed and not self.draft_compiled  # its replays compile the draft
        self.draft_compiled = self.draft_compiled or replayed

        def alone(m: torch.nn.Module) -> Row:
            return compiled_row(
                lambda: engine_row(
                    name, m, sizes, bandwidth, role="target", forward_path="compiled"
                ),
                self.eager.get((name, "engine")),
                "ms_per_token",
                device=device,
            )

        def drafting(m: torch.nn.Module) -> Row:
            return compiled_row(
                lambda: overhead_row(name, m, sizes, COMPILED_K, forward_path="compiled"),
                self.eager.get((name, COMPILED_K)),
                "round_ms",
                device=device,
            )

        def replays(m: torch.nn.Module) -> list[Row]:
            if draft is None:
                raise PhaseSkipped("the draft was not built")
            traces = load_replay_traces()
            plan = (QUICK_REPLAYS if self.args.quick else REPLAYS).get(name, ())
            missing = [f"{s}/{t}" for s, t in plan if (s, t) not in traces]
            if missing:
                raise RuntimeError(f"no trace {', '.join(missing)} in {TRACES}")
            requests = sizes.replay_requests
            if self.args.quick and self.shapes == "real":
                requests = QUICK_REPLAY_REQUESTS
            wanted = [(s, traces[s, t]) for s, t in plan]
            return replay_rows(name, m, draft, wanted, requests=requests)

        self.table.phase(
            "attention",
            f"target {name}: SDPA at the compiled shapes",
            self.measured(model, lambda m: attention_row(name, m, sizes)),
        )
        self.table.phase(
            "compiled",
            f"target {name}, mode target",
            self.measured(model, alone),
            needs=self.compile_needs(name),
            compiles=label,
        )
        self.table.phase(
            "compiled",
            f"target {name}: V(n), compiled",
            self.measured(model, lambda m: compiled_cost_row(name, m, sizes)),
            compiles=label,
        )
        if loop:
            self.table.phase(
                "compiled",
                f"target {name} drafting for itself, FLy K={COMPILED_K}",
                self.measured(model, drafting),
                compiles=label,
            )
        if replayed:
            self.table.phase(
                "replay",
                f"traces on the {name} target",
                self.measured(model, replays),
                needs=self.compile_needs(DRAFT) if draft_first else 0,
                compiles=self.label(DRAFT) if draft_first else label,
            )

    def measure_draft(self) -> None:
        draft = self.build(DRAFT)
        rows = self.table.phase(
            "forward cost",
            f"draft {DRAFT}: d",
            self.measured(draft, lambda m: forward_cost_row(DRAFT, m, self.sizes, draft=True)),
        )
        costs = self.table.value(rows, "median_ms")
        self.draft_ms = None if costs is None else costs[1]
        self.table.phase(
            "engine alone",
            f"draft {DRAFT}",
            self.measured(
                draft, lambda m: engine_row(DRAFT, m, self.sizes, self.bandwidth, role="draft")
            ),
        )

    def measure_target(self, name: str) -> None:
        model = self.build(name)
        rows = self.table.phase(
            "forward cost",
            f"target {name}: V(n)",
            self.measured(model, lambda m: forward_cost_row(name, m, self.sizes, draft=False)),
        )
        costs = self.table.value(rows, "median_ms")
        rows = self.table.phase(
            "engine alone",
            f"target {name}",
            self.measured(
                model, lambda m: engine_row(name, m, self.sizes, self.bandwidth, role="target")
            ),
        )
        engine_ms = self.table.value(rows, "ms_per_token")
        self.eager[name, "engine"] = rows[0]
        if name == self.targets[0]:
            self.table.phase(
                "profile",
                f"target {name}, eager",
                self.measured(model, lambda m: profile_row(name, m, self.sizes)),
            )
        overhead_ms = {}
        for k in self.ks:
            rows = self.table.phase(
                "loop overhead",
                f"target {name} drafting for itself, FLy K={k}",
                self.measured(model, lambda m, k=k: overhead_row(name, m, self.sizes, k)),
            )
            self.eager[name, k] = rows[0]
            if (value := self.table.value(rows, "overhead_ms_per_round")) is not None:
                overhead_ms[k] = value

        def project() -> list[Row]:
            if costs is None or self.draft_ms is None:
                raise PhaseSkipped("forward costs missing")
            return projection_rows(
                name, costs, self.draft_ms, engine_ms=engine_ms, overhead_ms=overhead_ms
            )

        self.table.phase("projection", f"the {name} target", project)


def describe(env: dict) -> str:
    shapes = {
        "tiny": "; TINY shapes (a check of the script, not figures)",
        "rehearsal": "; REHEARSAL shapes (the real layers, heads and vocabularies, narrowed: "
        "a rehearsal of the GPU run, not figures)",
    }
    return (
        f"{env['dtype']}; torch {env['torch']}, transformers {env['transformers']}, Python "
        f"{env['python']}; commit {env['commit'] or 'unknown'}; {env['date']}"
        + shapes.get(env.get("shapes", "real"), "")
    )


def shapes_of(args: argparse.Namespace) -> str:
    """The models' shapes (:data:`SHAPES`) the arguments ask for."""
    return "tiny" if args.tiny else "rehearsal" if args.rehearse else "real"


def compile_rows(phases: Sequence[PhaseCompiles], *, shapes: str) -> list[Row]:
    """One row per model: the graphs its phases compiled, each compile's seconds, cold (built
    by inductor) or warm (from inductor's cache). Failed where a compile failed, or, with
    shapes of their own for every model (not ``tiny``), where a model compiled no graph."""
    by_model: dict[str, list[PhaseCompiles]] = {}
    for phase in phases:
        key = phase.model or f"none expected ({phase.phase}: {phase.subject})"
        if phase.model or phase.compiles:
            by_model.setdefault(key, []).append(phase)
    rows = []
    for model, its in by_model.items():
        compiles = [c for phase in its for c in phase.compiles]
        failures = [c.failure for c in compiles if c.failure]
        seconds = [c.seconds for c in compiles]
        cold = sum(not c.cached for c in compiles)
        values = {
            "graphs": len(compiles),
            "compile_s": [round(t, 2) for t in seconds],
            "cold": cold,
            "failures": failures,
            "phases": [f"{phase.phase}: {phase.subject}" for phase in its if phase.compiles],
        }
        result = f"{len(compiles)} graphs, {sum(seconds):.1f} s compiling"
        detail = (
            f"each: {', '.join(f'{t:.1f} s' for t in seconds) or 'none'}; {cold} cold, "
            f"{len(compiles) - cold} from inductor's cache; in "
            + ("; ".join(values["phases"]) or "no phase")
        )
        status = "ok"
        if failures:
            status, result = "failed", f"{len(failures)} compiles failed ({failures[0]}); {result}"
        elif not compiles and shapes != "tiny":
            status, result = "failed", "no graph compiled: it ran eagerly"
        elif model.startswith("none expected"):
            status, result = "failed", f"compiled where no compile was expected: {result}"
        rows.append(Row("compiles", model, status, result, detail, values))
    return rows


@dataclass(frozen=True)
class Goal:
    """A goal of the GPU engine: the row (``phase``, a part of its ``subject``) and value it
    is read from, the bound it must meet, and whether smaller is better."""

    name: str
    phase: str
    subject: str
    key: str
    bound: float
    smaller: bool = True
    unit: str = ""


GOALS = (
    Goal(
        "target alone, compiled, engine/bound, 32B shape",
        "compiled",
        "target 32b, mode target",
        "engine_over_bound",
        1.3,
    ),
    Goal(
        "target alone, compiled, engine/bound, 7B shape",
        "compiled",
        "target 7b, mode target",
        "engine_over_bound",
        1.3,
    ),
    Goal(
        "target alone, compiled, engine/bound, 1.5B",
        "compiled",
        "target 1.5b, mode target",
        "engine_over_bound",
        2.0,
    ),
    Goal(
        "loop time per round beyond its forwards",
        "compiled",
        "drafting for itself",
        "overhead_ms_per_round",
        0.3,
        unit=" ms",
    ),
    Goal("host reads per round", "compiled", "drafting for itself", "syncs_per_round", 1.0),
    Goal(
        "FLy at the real pair's trace, 32B shape, over the compiled target alone",
        "replay",
        "fly@15 (humaneval) on the 32b target",
        "speedup",
        2.5,
        smaller=False,
        unit="x",
    ),
    Goal(
        "Predicted Outputs at predict-draft@15, 7B shape, over plain compiled decoding",
        "replay",
        "predict-draft@15 (humaneval-edit) on the 7b target",
        "speedup",
        4.0,
        smaller=False,
        unit="x",
    ),
)
"""The goals of the GPU engine, read from the rows; the loop's two goals from the compiled
row of a target drafting for itself."""


def goal_rows(rows: Sequence[Row], *, on_cuda: bool) -> list[Row]:
    """One row per goal (:data:`GOALS`, and the same tokens of exact decoding, eager and
    compiled): met, missed or not run, with its figure. Off CUDA the figures are the CPU's,
    a rehearsal of the table, not of the goals."""
    where = "" if on_cuda else "; on the CPU: a rehearsal of this table, not a GPU figure"
    table = []
    for goal in GOALS:
        found = [r for r in rows if r.phase == goal.phase and goal.subject in r.subject]
        value = next(
            (r.values[goal.key] for r in found if r.values.get(goal.key) is not None), None
        )
        sign = "<=" if goal.smaller else ">="
        aim = f"goal {sign} {goal.bound:g}{goal.unit}"
        if value is None:
            why = found[0].status if found else "no such row"
            if found and found[0].status == "ok":
                why = "not measured on this device"
            result, values = f"NOT RUN ({why}); {aim}", {"met": None}
        else:
            met = value <= goal.bound if goal.smaller else value >= goal.bound
            result = f"{'MET' if met else 'MISSED'}: {value:.3g}{goal.unit}; {aim}"
            values = {"met": met, "value": value, "bound": goal.bound}
        subject = found[0].subject if found else goal.subject
        table.append(Row("goal", goal.name, "ok", result, f"from {subject}{where}", values))
    exact = [
        r
        for r in rows
        if r.phase == "same tokens"
        and (r.subject.startswith("spd") or "against eager" in r.subject)
    ]
    ran = [r for r in exact if r.status != "skipped"]
    if not ran:
        result, met = "NOT RUN; goal: every row the target's tokens", None
    else:
        met = len(ran) == len(exact) and all(r.status == "ok" for r in ran)
        same = sum(r.status == "ok" for r in ran)
        result = f"{'MET' if met else 'MISSED'}: {same}/{len(exact)} rows the target's tokens"
    table.append(
        Row(
            "goal",
            "exact SPD and prediction tokens = the target's, float32, eager and compiled",
            "ok",
            result,
            "the same tokens rows of exact decoding" + where,
            {"met": met},
        )
    )
    return table


def resolve_dtype(name: str, device: torch.device, *, rehearse: bool = False) -> torch.dtype:
    """``auto``: bfloat16 on a GPU and in the rehearsal of one, float32 on the CPU otherwise
    (where bfloat16 is slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or rehearse else torch.float32
    return getattr(torch, name)


def parse_targets(text: str) -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise SystemExit(f"--targets takes some of {','.join(TARGETS)}, got {text!r}")
    return names


def markdown(rows: Sequence[Row]) -> str:
    """The table: one line per row, a failed or skipped row's reason in its result."""
    lines = ["| phase | subject | result | detail |", "|---|---|---|---|"]
    for row in rows:
        result = row.result if row.status == "ok" else f"{row.status.upper()}: {row.result}"
        cells = (row.phase, row.subject, result, row.detail)
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def write_outputs(folder: Path, env: dict, rows: Sequence[Row]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    report = {"script": "benchmarks/gpu_first_look.py", "environment": env}
    report["rows"] = [asdict(row) for row in rows]
    (folder / "gpu_first_look.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    partial = "" if env.get("complete") else " PARTIAL: the rows so far of a run not ended."
    (folder / "gpu_first_look.md").write_text(
        f"# First GPU figures\n\n{env['device_description']}; {describe(env)}; "
        f"{env['elapsed_s']} s.{partial}\n\n{markdown(rows)}\n"
    )


def output_folders(args: argparse.Namespace) -> list[Path]:
    """Where the table is written: ``$OUT`` when set, and ``--output``."""
    folders = [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
    return folders + ([args.output] if args.output else [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU form)")
    shapes.add_argument(
        "--rehearse",
        action="store_true",
        help="the CPU rehearsal: every model with its real layers, heads and vocabulary, "
        f"narrowed {REHEARSAL_WIDTH_DIVISOR}-fold, no time limit unless given",
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help="some of 1.5b,7b,32b")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--output", type=Path, help="also write the JSON and Markdown here")
    parser.add_argument(
        "--time-limit",
        type=float,
        help="skip phases that would start later (s; default 420, with --quick 300; none with "
        "--rehearse or --tiny)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on the CPU (default 1: shared cores)"
    )
    parser.add_argument("--kernel-batches", type=int, help="conformance batches (default 60)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the rows the goals name: the same tokens (lossless, compiled against eager), "
        "the targets compiled, the loop's cost per round, the goals' replays",
    )
    args = parser.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = math.inf if args.rehearse or args.tiny else 300 if args.quick else 420
    first_look = FirstLook(args)
    env, rows = first_look.run()
    print(markdown(rows), flush=True)
    for folder in first_look.folders:
        write_outputs(folder, env, rows)
        log(f"wrote {folder}/gpu_first_look.json and .md")
    failed = [r for r in rows if r.status == "failed"]
    log(f"done in {env['elapsed_s']} s: {len(rows)} rows, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
