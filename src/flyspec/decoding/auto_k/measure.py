"""``-k auto``'s cost measurer: it runs the forwards the policy
(:mod:`~flyspec.decoding.auto_k.policy`) chooses from, timed by flyspec's one forward timer
(:func:`flyspec.models.timing.device_clock`, as the bench times forwards), and has a draft
model catch up on the context it skipped."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from flyspec.decoding.auto_k.policy import AutoKPolicies, ForwardCosts, probe_sizes
from flyspec.decoding.auto_k.store import CostStore
from flyspec.models.cache import common_prefix_length
from flyspec.models.timing import device_clock


def measure_costs(
    policies: AutoKPolicies,
    target,
    context: Sequence[int],
    config,
    *,
    draft_lm=None,
    store: CostStore | None = None,
) -> None:
    """Measure what ``-k auto`` chooses from, once, into ``policies`` (what one request
    learns, the next starts from): ``target``'s forward costs over ``context`` for the sizes not
    yet measured (each size twice, keeping the faster: the first forwards of a process
    may run cold); ``draft_lm``'s seconds per token where it drafts (it reads the context
    first). ``context`` must be cached but for its last token. With a ``store``, the
    costs an earlier process measured there count as measured, and what is measured
    here is added to it."""
    if policies.block_costs is None and store is not None:
        policies.block_costs, policies.draft_token_seconds = store.load()
    largest = min(config.k, config.max_new_tokens - 1) + 1
    room = target.context_length
    sizes = probe_sizes(largest, room=None if room is None else room - len(context) + 1)
    known = {} if policies.block_costs is None else policies.block_costs.seconds
    measured = False
    if not set(sizes) <= set(known):
        first = measure_block_costs(target, context, sizes)
        second = measure_block_costs(target, context, sizes)
        known = {**known, **{n: min(first[n], second[n]) for n in sizes}}
        policies.block_costs = ForwardCosts(known)
        measured = True
    if draft_lm is not None and policies.draft_token_seconds == 0:
        catch_up(draft_lm, context)
        policies.draft_token_seconds = measure_block_costs(draft_lm, context, [1])[1]
        measured = True
    if measured and store is not None:
        store.save(policies.block_costs, policies.draft_token_seconds)


def catch_up(draft_lm, context: Sequence[int]) -> float:
    """Have ``draft_lm`` (a :class:`~flyspec.models.cache.LanguageModel` that drafts only some
    blocks) read the part of ``context`` it has not seen: the prompt, the rounds it did not
    draft. A draft at most two positions behind (after a drafting round: the correction, or
    the last draft token and the bonus) reads them in its first drafting forward, as with a
    fixed K. Its seconds."""
    seen = common_prefix_length(draft_lm.cached_tokens, context)
    if len(context) - seen <= 2:
        return 0.0
    started = time.perf_counter()
    draft_lm.prefill(list(context[:-1]))
    return time.perf_counter() - started


def measure_block_costs(lm, context: Sequence[int], sizes: Iterable[int]) -> dict[int, float]:
    """Seconds of one forward of ``lm`` (a :class:`~flyspec.models.cache.LanguageModel`) over n
    tokens after ``context``, for each n of ``sizes``: the last context token plus n - 1 copies
    of it, the shape of a verification. The context must be cached but for its last token;
    the next call with the real block reuses it (the model's cache keeps the common prefix).
    Timed by :func:`flyspec.models.timing.device_clock`, as the bench times forwards."""
    measured: dict[int, float] = {}
    filler = list(context[-1:])
    clock = device_clock(lm.device)
    for n in sizes:
        started = clock()
        lm.logits(list(context) + filler * (n - 1), n)
        measured[n] = clock() - started
    return measured
