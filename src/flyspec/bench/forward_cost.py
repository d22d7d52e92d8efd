"""How much a forward over n new tokens costs relative to one token, on top of a KV cache.

Speculative decoding pays off on a CPU only when the target's forward over the last committed
token plus a K-token draft block costs little more than a one-token forward (DESIGN.md
section 6). :func:`measure_forward_cost` times exactly that forward, for n = 1 .. K+1, the way
the decoder runs it (its forward path, logits for the n positions), on a cache of
``context_tokens`` positions that is cropped back after every timed call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardCost:
    """Median wall time of one forward over ``new_tokens`` tokens, and its ratio to n = 1."""

    new_tokens: int
    median_ms: float
    min_ms: float
    ratio: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "new_tokens": self.new_tokens,
            "median_ms": round(self.median_ms, 3),
            "min_ms": round(self.min_ms, 3),
            "ratio": round(self.ratio, 4),
        }


@torch.inference_mode()
def measure_forward_cost(
    model: torch.nn.Module,
    *,
    max_new_tokens: int,
    context_tokens: int = 200,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    forward_path: str = "lean",
) -> list[ForwardCost]:
    """Time one forward over n = 1 .. ``max_new_tokens`` new tokens after ``context_tokens``.

    The repeats are interleaved over n (1, 2, .., N, 1, 2, ..) so that a drifting machine load
    hits every n alike; ``warmup`` untimed rounds over all n come first. Token ids are random
    (the cost does not depend on them). ``clock`` may be ``time.thread_time`` to count CPU time
    only, which a busy machine disturbs less (with one torch thread). ``forward_path`` is the
    decoder's (:func:`flyspec.models.cache.make_forward`).
    """
    from flyspec.models.cache import make_forward

    if max_new_tokens < 1 or context_tokens < 1 or repeats < 1:
        raise ValueError("max_new_tokens, context_tokens and repeats must be >= 1")
    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(vocab_size, (1, context_tokens), generator=generator).to(device)
    extra = torch.randint(vocab_size, (1, max_new_tokens), generator=generator).to(device)
    runner = make_forward(model, forward_path)
    runner.forward(context, 1)

    times: dict[int, list[float]] = {n: [] for n in range(1, max_new_tokens + 1)}
    for repeat in range(warmup + repeats):
        for n in times:
            runner.crop(context_tokens)
            started = clock()
            runner.forward(extra[:, :n], n)
            elapsed = clock() - started
            if repeat >= warmup:
                times[n].append(elapsed)
    base = statistics.median(times[1])
    return [
        ForwardCost(
            new_tokens=n,
            median_ms=1000 * statistics.median(samples),
            min_ms=1000 * min(samples),
            ratio=statistics.median(samples) / base,
        )
        for n, samples in times.items()
    ]


def format_forward_cost(costs: dict[str, list[ForwardCost]]) -> str:
    """A Markdown table: one row per n, a ms and a ratio column per model."""
    names = list(costs)
    header = "| n | " + " | ".join(f"{name} ms | {name} ratio" for name in names) + " |"
    rule = "|---:|" + "---:|---:|" * len(names)
    rows = []
    for index in range(len(next(iter(costs.values()), []))):
        cells = [str(costs[names[0]][index].new_tokens)]
        for name in names:
            cost = costs[name][index]
            cells += [f"{cost.median_ms:.1f}", f"{cost.ratio:.2f}x"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *rows])
