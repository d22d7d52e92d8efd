"""``forward cost``: ``V(n)``, the target's forward over n = 1..16 new tokens after 300 cached
ones (24 in the tiny form) through flyspec's lean forward
(:func:`flyspec.bench.forward_cost.measure_forward_cost`, the device waited for around each
timed forward), and ``d``, the draft's one-token forward."""

from __future__ import annotations

import torch

from flyspec.bench.forward_cost import measure_forward_cost
from flyspec.models.timing import device_clock

from ..plan import Sizes
from ..table import Row, fmt_ms

MAX_NEW_TOKENS = 16  # V(n) for n = 1 .. 16: a block of 15 drafted tokens and the last one


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
