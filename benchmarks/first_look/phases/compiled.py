"""``compiled``: each target through the compiled forward (``--forward compiled``, the default
on CUDA: ``torch.compile``, CUDA graphs on a GPU): alone, against the bound and the eager row
of the same run; its ``V(n)`` at the compiled sizes up to 65 (a prediction's block of 64 and
the token before it); the first target drafting for itself at K=8 (the loop's time and host
synchronisations per round). Each row with the graphs compiled, on CUDA how many ran without
a CUDA graph, the time the row took with compiling, and how many of its tokens are the eager
decode's (told, not failed: compiling reorders the arithmetic)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from flyspec.bench.forward_cost import time_forwards
from flyspec.models.cache import common_prefix_length
from flyspec.models.lean import COMPILED_SIZES
from flyspec.models.timing import device_clock

from ..plan import Sizes
from ..table import Row, fmt_ms


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
