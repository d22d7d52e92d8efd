"""What a run measures: the sizes of its full and tiny forms, the targets' order and the traces
replayed on each, the block sizes, and the time a phase that compiles a model is given."""

from __future__ import annotations

from dataclasses import dataclass

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
OVERHEAD_KS = (4, 8, 15)  # the loop overhead rows' block sizes, with those of the tau file
COMPILED_K = 8  # the block size of the compiled loop row
SAME_TOKENS_TARGET = "1.5b"  # the same tokens rows' target, and their block size
SAME_TOKENS_K = 8
COMPILE_BUDGET_S = {"32b": 160, "7b": 80, "1.5b": 80, "0.5b": 60}
"""What a phase that compiles a model's two graphs is given before the time limit, by model:
the CPU rehearsal's cold compile of the model's shape (2-core Xeon, 2026-12-05), which the
lent H200 matched or beat 1-3x on the one graph it compiled (docs/benchmarks.md, "The lease
rehearsed on the CPU"). A phase that would end past the limit is skipped, so that a cut
``--quick`` keeps its largest targets' rows."""


@dataclass(frozen=True)
class Sizes:
    """How much each phase runs: the full form on a GPU (:data:`FULL`), or the tiny form on a
    CPU (:data:`TINY`)."""

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


FORMS = {  # each size in the full form and in the tiny form
    "context": (300, 24),
    "repeats": (7, 2),
    "warmup": (2, 1),
    "engine_tokens": (96, 16),
    "overhead_tokens": (160, 40),
    "sync_tokens": (48, 20),
    "copy_bytes": (4 << 30, 16 << 20),
    "kernel_batches": (60, 9),
    "kernel_vocab": (151936, 64),
    "same_tokens": (48, 24),
    "replay_requests": (None, 1),
}
FULL = Sizes(**{name: full for name, (full, _) in FORMS.items()})
TINY = Sizes(**{name: tiny for name, (_, tiny) in FORMS.items()})
QUICK_REPLAY_REQUESTS = 4
