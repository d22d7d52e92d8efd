"""How much a forward over n new tokens costs relative to one token, on top of a KV cache.

Speculative decoding pays off on a CPU only when the target's forward over the last committed
token plus a K-token draft block costs little more than a one-token forward.
:func:`measure_forward_cost` times exactly that forward, for n = 1 .. K+1, the way the decoder
runs it (its forward path, logits for the n positions), on a cache of ``context_tokens``
positions that is cropped back after every timed call.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flyspec.models.timing import device_clock

if TYPE_CHECKING:
    from flyspec.models.cache import ForwardRunner


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
def time_runners(
    runners: Mapping[str, ForwardRunner],
    *,
    vocab_size: int,
    new_tokens: Sequence[int],
    context_tokens: int = 200,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] | None = None,
) -> dict[str, dict[int, list[float]]]:
    """Seconds of each timed forward over n new tokens after ``context_tokens`` cached ones,
    per named forward runner (:class:`~flyspec.models.cache.ForwardRunner`) and n:
    ``{name: {n: [s]}}``.

    The calls are interleaved over n and runners (n1 runner1, n1 runner2, n2 runner1, ...,
    then again) so that a drifting machine load hits all alike; ``warmup`` untimed rounds come
    first. Each runner is reset, fed the same context, and cropped back to it before every
    call. Token ids are random (the cost does not depend on them). ``clock``: None, flyspec's
    forward timer (:func:`flyspec.models.timing.device_clock`: it waits for the device).
    """
    if not new_tokens or min(new_tokens) < 1 or context_tokens < 1 or repeats < 1:
        raise ValueError("new_tokens, context_tokens and repeats must be >= 1")
    clock = clock or device_clock(torch.device(device))
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(vocab_size, (1, context_tokens), generator=generator).to(device)
    extra = torch.randint(vocab_size, (1, max(new_tokens)), generator=generator).to(device)
    for runner in runners.values():
        runner.reset()
        runner.forward(context, 1)

    times: dict[str, dict[int, list[float]]] = {r: {n: [] for n in new_tokens} for r in runners}
    for repeat in range(warmup + repeats):
        for n in new_tokens:
            for name, runner in runners.items():
                runner.crop(context_tokens)
                started = clock()
                runner.forward(extra[:, :n], n)
                elapsed = clock() - started
                if repeat >= warmup:
                    times[name][n].append(elapsed)
    return times


def time_forwards(
    model,
    *,
    new_tokens: Sequence[int],
    forward_paths: Sequence[str] = ("lean",),
    context_tokens: int = 200,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    clock: Callable[[], float] | None = None,
) -> dict[str, dict[int, list[float]]]:
    """:func:`time_runners` for one model: a torch module gets one runner per forward path
    (:func:`flyspec.models.cache.make_forward`); a :class:`~flyspec.models.cache.CachedLM`
    (such as a llama.cpp model, path ``llamacpp``) has its own runner, which is emptied after
    the timing. ``{path: {n: [s]}}``."""
    from flyspec.models.cache import CachedLM, make_forward

    if isinstance(model, CachedLM):
        runners = {model.forward_path: model.runner}
        vocab_size, device = model.vocab_size, model.device
    else:
        runners = {path: make_forward(model, path) for path in forward_paths}
        vocab_size = int(model.get_input_embeddings().weight.shape[0])
        device = next(model.parameters()).device
    try:
        return time_runners(
            runners,
            vocab_size=vocab_size,
            new_tokens=new_tokens,
            context_tokens=context_tokens,
            repeats=repeats,
            warmup=warmup,
            seed=seed,
            device=device,
            clock=clock,
        )
    finally:
        if isinstance(model, CachedLM):
            model.reset()  # the runner holds random ids the model has no record of


def measure_forward_cost(
    model,
    *,
    max_new_tokens: int,
    context_tokens: int = 200,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    clock: Callable[[], float] | None = None,
    forward_path: str = "lean",
) -> list[ForwardCost]:
    """Time one forward over n = 1 .. ``max_new_tokens`` new tokens after ``context_tokens``
    (:func:`time_forwards`, interleaved over n) with the decoder's ``forward_path``.

    ``clock`` may be ``time.thread_time`` to count CPU time only, which a busy machine disturbs
    less (with one torch thread); None: :func:`flyspec.models.timing.device_clock`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    times = time_forwards(
        model,
        new_tokens=range(1, max_new_tokens + 1),
        forward_paths=(forward_path,),
        context_tokens=context_tokens,
        repeats=repeats,
        warmup=warmup,
        seed=seed,
        clock=clock,
    )[forward_path]
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
