"""Verification of one draft block: pure tensor functions, no models, no caches.

Notation (docs/design.md), 0-based: ``K`` draft tokens ``draft_tokens[0..K-1]``; target
logits ``target_logits[0..K]`` from one forward over ``[last_committed, draft_tokens...]``, so
row ``i`` scores position ``i`` and row ``K`` gives the bonus token. ``V`` is the vocabulary size.

A block is verified in three steps: decide which positions the target *accepts* (exact match at
temperature 0, lossless speculative sampling above), let FLy *loosely accept* some of the
rejected positions (entropy gate + deferred window), then cut at the first position kept by
neither and append the target's *correction* there, or the *bonus* token when all were kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from flyspec.config import FlyConfig, SamplingConfig


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row: ``[..., V] -> long[...]`` (the first of tied maxima, as torch's
    own). On the CPU a float32 row is read by numpy's argmax, which vectorises the search that
    torch's CPU kernel runs element by element: over Qwen's vocabulary about 20x faster for
    one row, 5x for a block's 16 (docs/benchmarks.md, "Verification's row reductions")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(np.asarray(logits).argmax(axis=-1)))  # no copies
    return logits.argmax(dim=-1)


_CHUNK = 128
"""Values per chunk in :func:`largest_values`'s search on the CPU."""


def largest_values(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row, largest first: ``[..., V] -> [..., k]``, as
    ``topk(k).values``. On the CPU, where torch's top-k reads each element of a row, the rows
    are cut into chunks of :data:`_CHUNK` and the top-k searched only in the k chunks with
    the largest maxima (each of the k largest values lies in one of them: a value outside
    them has k larger chunk maxima above it); over Qwen's vocabulary that is 6-11x faster
    (docs/benchmarks.md, "Verification's row reductions")."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or vocab < 8 * k * _CHUNK or logits.numel() == 0:
        return logits.topk(k, dim=-1).values
    rows = logits.reshape(-1, vocab)
    if vocab % _CHUNK:
        rows = torch.nn.functional.pad(rows, (0, -vocab % _CHUNK), value=-math.inf)
    chunks = rows.reshape(rows.shape[0], -1, _CHUNK)  # [R, C, chunk]
    best = chunks.amax(dim=-1).topk(k, dim=-1).indices  # [R, k]
    picked = chunks.gather(1, best[..., None].expand(-1, -1, _CHUNK))  # [R, k, chunk]
    top = picked.reshape(rows.shape[0], k * _CHUNK).topk(k, dim=-1).values  # [R, k]
    return top.reshape(*logits.shape[:-1], k)


@dataclass(frozen=True)
class Deferral:
    """A mismatch whose deferred window runs past the end of its block (``FlyConfig.defer``).

    The round keeps it tentatively with the exact matches after it and the bonus; the next
    block must then start with ``need`` exact matches, or the round is rolled back to
    ``position`` with the target's ``correction`` there.
    """

    position: int
    need: int
    correction: int


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one block of ``num_drafted`` draft tokens.

    The round emits ``draft_tokens[:num_kept]`` (the drafted tokens it keeps, exact matches
    and loose ones alike; :class:`~flyspec.decoding.stats.RoundStats` counts them apart) and then
    ``next_token``: the target's correction at position ``num_kept`` if
    ``num_kept < num_drafted``, else the bonus.
    ``loose_positions`` are the indices (all ``< num_kept``) kept loosely by FLy.
    With a ``deferral`` the whole block and the bonus are kept tentatively
    (``num_kept == num_drafted``); the deferred position is not in ``loose_positions``.
    ``draft_ids``: every draft token as read with the verdict at temperature 0 (a block cut
    after an end token by :func:`verify_greedy` has more of them than ``num_drafted``).
    ``device_tokens``: the draft tokens ``long[K]`` and the target's tokens ``long[K+1]`` on
    the device, where the target chose its tokens there (temperature 0): what the round
    commits is then on the device too (:meth:`tokens_on_device`). ``position_features``: with
    FLy at temperature 0, what the target thought of every drafted position
    (:func:`loose_token_features`' columns, and the draft's ``draft_confidence`` where it has
    one), read with the verdict: a loosely kept token's record costs no read of its own.
    """

    num_drafted: int
    num_kept: int
    loose_positions: tuple[int, ...]
    next_token: int
    deferral: Deferral | None = None
    draft_ids: tuple[int, ...] = ()
    device_tokens: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )
    position_features: dict[str, tuple[float, ...]] | None = None

    @property
    def is_bonus(self) -> bool:
        return self.num_kept == self.num_drafted

    @property
    def num_loose(self) -> int:
        return len(self.loose_positions)

    def without_deferral(self) -> Verdict:
        """The plain verdict: cut at the deferred position with the target's correction."""
        if self.deferral is None:
            return self
        return Verdict(
            num_drafted=self.num_drafted,
            num_kept=self.deferral.position,
            loose_positions=self.loose_positions,
            next_token=self.deferral.correction,
            device_tokens=self.device_tokens,
            position_features=self.position_features,
        )

    def tokens_on_device(self) -> torch.Tensor | None:
        """``long[num_kept + 1]`` on the device: the kept draft tokens and then the next
        token, the tokens the round commits (None where the device does not hold them)."""
        if self.device_tokens is None:
            return None
        draft_tokens, target_tokens = self.device_tokens
        cut = self.num_kept
        return torch.cat((draft_tokens[:cut], target_tokens[cut : cut + 1]))

    def correction_on_device(self) -> torch.Tensor | None:
        """``long[1]`` on the device: the deferral's correction (None where the device does
        not hold it, or there is no deferral)."""
        if self.device_tokens is None or self.deferral is None:
            return None
        position = self.deferral.position
        return self.device_tokens[1][position : position + 1]

    @property
    def num_leading_exact(self) -> int:
        """How many positions from the start of the block matched exactly: what completes a
        window deferred from the block before."""
        mismatches = list(self.loose_positions)
        if self.deferral is not None:
            mismatches.append(self.deferral.position)
        return min([self.num_kept, *mismatches])


# --------------------------------------------------------------------------- entropy


def top3_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats restricted to the 3 most likely tokens: ``[..., V] -> [...]``.

    The probabilities come from the full softmax of the logits and are not renormalised
    (the authors' released gate). Only the top 3 logits and a logsumexp are needed. A token
    of probability 0 (a logit of -inf: a row masked to fewer than 3 tokens) adds nothing.
    """
    logits = logits.float()
    top_logits = largest_values(logits, min(3, logits.shape[-1]))
    top_log_probs = top_logits - logits.logsumexp(dim=-1, keepdim=True)
    terms = top_log_probs.exp() * top_log_probs
    return -torch.where(top_log_probs > -math.inf, terms, torch.zeros_like(terms)).sum(dim=-1)


def normalized_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy divided by log |V| (in [0, 1]): ``[..., V] -> [...]``."""
    probs = logits.float().softmax(dim=-1)
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)
    return entropy / math.log(logits.shape[-1])


def target_entropy(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """The gate's entropy of the kind named in :class:`FlyConfig`: ``[..., V] -> [...]``."""
    if kind == "top3":
        return top3_entropy(logits)
    if kind == "normalized":
        return normalized_entropy(logits)
    raise ValueError(f"unknown entropy kind {kind!r}")


# --------------------------------------------------------------------------- FLy rule


def request_of_positions(cu_num_drafted: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Which request each flattened draft position belongs to: ``long[B] -> long[T]``.

    ``cu_num_drafted[r]`` is the exclusive end of request ``r``'s block in the flattened batch
    (the cumulative sum of the per-request draft counts, as vLLM passes it). No host sync.
    """
    positions = torch.arange(num_positions, device=cu_num_drafted.device)
    return torch.searchsorted(cu_num_drafted.long(), positions, right=True)


def _block_bounds(
    cu_num_drafted: torch.Tensor, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(request_of, block_start, block_end)``, each ``long[T]``: the request of every
    flattened position and the bounds of its block."""
    cu_num_drafted = cu_num_drafted.long()
    request_of = request_of_positions(cu_num_drafted, num_positions)
    block_start = torch.cat([cu_num_drafted.new_zeros(1), cu_num_drafted[:-1]])
    return request_of, block_start[request_of], cu_num_drafted[request_of]


def window_holds(
    accepted: torch.Tensor, *, window: int, cu_num_drafted: torch.Tensor | None = None
) -> torch.Tensor:
    """Whether the ``window`` positions after each position are all accepted and inside its
    block (``i + window <= end - 1``): ``bool[T] -> bool[T]``. One block by default; a
    flattened batch of ragged blocks with ``cu_num_drafted`` (``long[B]``, the cumulative
    per-request draft counts). Vectorised, no host sync, and for one block no tensor made
    from host values (on CUDA, a copy that waits)."""
    num_positions = accepted.shape[0]
    # rejections_before[j] = number of rejected positions in [0, j) of the flattened batch.
    rejections_before = torch.zeros(num_positions + 1, dtype=torch.long, device=accepted.device)
    rejections_before[1:] = (~accepted).long().cumsum(0)
    positions = torch.arange(num_positions, device=accepted.device)
    window_end = positions + window + 1  # exclusive end of the window after position i
    if cu_num_drafted is None:  # one block, which ends with the last position
        fits = window_end <= num_positions
        clamped_end = window_end.clamp(max=num_positions)
    else:
        _, _, block_end = _block_bounds(cu_num_drafted, num_positions)
        fits = window_end <= block_end
        clamped_end = torch.minimum(window_end, block_end)
    return fits & (rejections_before[clamped_end] == rejections_before[positions + 1])


def plausible(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    min_ratio: float,
    max_rank: int,
) -> torch.Tensor:
    """The plausibility floor: where the target itself finds the draft token plausible.
    ``[T, V], long[T] -> bool[T]``.

    The target's probability of the draft token must be at least ``min_ratio`` times that of
    its top token (a ratio within the softmax of the logits verified with, so independent of
    how many tokens share the mass), and the draft token must be among its ``max_rank``
    most likely tokens (ties with the draft token count in its favour). 0 switches either
    test off. Negative (placeholder) draft ids are treated as token 0: callers mask them.
    """
    if min_ratio <= 0 and max_rank <= 0:
        return torch.ones(draft_tokens.shape, dtype=torch.bool, device=target_logits.device)
    logits = target_logits.float()
    draft_logits = logits.gather(1, draft_tokens.long().clamp_min(0)[:, None])  # [T, 1]
    ok = torch.ones(draft_tokens.shape, dtype=torch.bool, device=logits.device)
    if min_ratio > 0:
        log_ratio = draft_logits.squeeze(1) - logits.max(dim=-1).values
        ok &= log_ratio >= math.log(min_ratio)
    if max_rank > 0:
        ok &= (logits > draft_logits).sum(dim=-1) < max_rank
    return ok


def draft_unsure(
    draft_confidence: torch.Tensor | None,
    num_positions: int,
    *,
    max_draft_confidence: float,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The draft's doubt: where the draft model gave its own token at most
    ``max_draft_confidence``. ``float[T] | None -> bool[T]`` on ``device``.

    1 switches the test off. ``None`` (a drafter without a model, such as prompt lookup)
    counts as sure, so with the test on nothing of it is loosened.
    """
    if max_draft_confidence >= 1 or draft_confidence is None:
        return torch.full(
            (num_positions,), max_draft_confidence >= 1, dtype=torch.bool, device=device
        )
    return (draft_confidence <= max_draft_confidence).to(device)


def loosening_candidates(
    accepted: torch.Tensor,
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    allowed: torch.Tensor,
    *,
    fly: FlyConfig,
    draft_confidence: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rejected positions that FLy keeps if their window holds: ``allowed`` (the target could
    emit the draft token at all), past the entropy gate, above the plausibility floor, and
    where the draft was unsure enough (:func:`draft_unsure`).
    ``bool[T], [T, V], long[T], bool[T], float[T] | None -> bool[T]``. ``entropy``
    ``float[T]``: the gate's entropy of the rows where the caller has it already."""
    if entropy is None:
        entropy = target_entropy(target_logits, fly.entropy)
    floor = plausible(target_logits, draft_tokens, min_ratio=fly.min_ratio, max_rank=fly.max_rank)
    doubt = draft_unsure(
        draft_confidence,
        accepted.shape[0],
        max_draft_confidence=fly.max_draft_confidence,
        device=accepted.device,
    )
    return ~accepted & allowed & (entropy >= fly.theta) & floor & doubt


def loosely_accepted(
    accepted: torch.Tensor,
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    allowed: torch.Tensor,
    *,
    fly: FlyConfig,
    cu_num_drafted: torch.Tensor | None = None,
    draft_confidence: torch.Tensor | None = None,
) -> torch.Tensor:
    """FLy's loosely accepted positions: :func:`loosening_candidates` whose deferred window
    holds inside their block. ``bool[T], [T, V], long[T], bool[T] -> bool[T]``; one block, or
    a flattened batch of ragged blocks with ``cu_num_drafted`` as in :func:`window_holds`."""
    candidates = loosening_candidates(
        accepted, target_logits, draft_tokens, allowed, fly=fly, draft_confidence=draft_confidence
    )
    return candidates & window_holds(accepted, window=fly.window, cu_num_drafted=cu_num_drafted)


def deferred_need(
    accepted: Sequence[bool], candidates: Sequence[bool], *, cut: int, window: int
) -> int:
    """How many exact matches the next block must start with to complete the window of the
    mismatch at ``cut``, or 0 when it cannot be deferred. ``bool[K], bool[K] -> int``
    (lists, or tensors on the CPU).

    Deferrable: ``cut`` is a loosening candidate whose window runs past the end of the block
    and every position after it in the block matched exactly.
    """
    num_drafted = len(accepted)
    if cut >= num_drafted or not candidates[cut]:
        return 0
    tail = num_drafted - 1 - cut
    if tail >= window or not all(accepted[cut + 1 :]):
        return 0
    return window - tail


def loose_token_features(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, *, entropy: str
) -> dict[str, torch.Tensor]:
    """What the target thought of loosely kept draft tokens: ``[N, V], long[N] -> {name: [N]}``.

    ``entropy`` (of the gate's kind), ``draft_prob`` and ``top_prob`` (softmax of the raw
    logits), ``ratio`` (draft_prob / top_prob), ``rank`` (1 = the target's top token) and
    ``target_token`` (its argmax).
    """
    logits = target_logits.float()
    log_probs = logits.log_softmax(dim=-1)
    draft_log_probs = log_probs.gather(1, draft_tokens.long()[:, None]).squeeze(1)
    top_log_probs, target_tokens = log_probs.max(dim=-1)
    return {
        "entropy": target_entropy(logits, entropy),
        "draft_prob": draft_log_probs.exp(),
        "top_prob": top_log_probs.exp(),
        "ratio": (draft_log_probs - top_log_probs).exp(),
        "rank": (log_probs > draft_log_probs[:, None]).sum(dim=-1) + 1,
        "target_token": target_tokens,
    }


def kept_prefix(kept: torch.Tensor, cu_num_drafted: torch.Tensor) -> torch.Tensor:
    """Which positions come before their block's cut (the first unkept position), i.e. are
    emitted: ``bool[T], long[B] -> bool[T]``. Vectorised, no host sync."""
    _, block_start, _ = _block_bounds(cu_num_drafted, kept.shape[0])
    # unkept_through[j + 1] = number of unkept positions in [0, j] of the flattened batch.
    unkept_through = torch.zeros(kept.shape[0] + 1, dtype=torch.long, device=kept.device)
    unkept_through[1:] = (~kept).long().cumsum(0)
    return unkept_through[1:] == unkept_through[block_start]


def speculative_acceptance(
    target_at_draft: torch.Tensor, draft_at_draft: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Lossless speculative sampling's acceptance test at each drafted position, accepting
    with probability ``min(1, target / draft)``: ``float[T] x 3 -> bool[T]``. A draft
    probability of 0 (never sampled) rejects."""
    return (draft_at_draft > 0) & (uniforms * draft_at_draft < target_at_draft)


def first_unkept(kept: Sequence[bool]) -> int:
    """Index of the first False in ``bool[K]``, or K when all are True."""
    return next((index for index, keep in enumerate(kept) if not keep), len(kept))


def _verdict(
    *,
    accepted: torch.Tensor,
    candidates: torch.Tensor,
    next_token: torch.Tensor | Callable[[int], int],
    fly: FlyConfig | None,
    draft_tokens: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
    features: dict[str, torch.Tensor] | None = None,
) -> Verdict:
    """The verdict on a block from its accepted positions and its loosening candidates
    (:func:`loosening_candidates`; all False without FLy): the candidates whose window holds
    are kept loosely, and a candidate at the cut may be deferred. ``next_token``: the target's
    token at each possible cut ``long[K+1]`` where it does not depend on the cut (temperature
    0), else a function that draws it for a cut. ``draft_tokens`` ``long[K]`` are read along
    (:attr:`Verdict.draft_ids`), and ``length`` ``long[1]``, the positions of the block that
    count (K where None: positions past it are neither accepted nor candidates).
    ``features``: ``{name: [K]}`` read along (:attr:`Verdict.position_features`).

    The masks, with the tokens at the cuts, the draft tokens, the length and the features
    when given, are read from the device at once (as float64, which holds token ids
    exactly): one host synchronisation, whatever K (and a draw's own at temperature > 0)."""
    num_drafted = accepted.shape[0]
    loose = candidates
    if fly is not None:
        loose = candidates & window_holds(accepted, window=fly.window)
    parts = [torch.stack([accepted, candidates, loose]).flatten()]  # [3K]
    for extra in (next_token, draft_tokens, length):  # [K + 1], [K], [1]
        if isinstance(extra, torch.Tensor):
            parts.append(extra)
    parts += (features or {}).values()  # [K] each
    values = torch.cat([part.double() for part in parts]).tolist()
    accepted_at, candidate_at, loose_at = (
        values[i * num_drafted : (i + 1) * num_drafted] for i in range(3)
    )
    rest = values[3 * num_drafted :]
    token_at = next_token
    if isinstance(next_token, torch.Tensor):
        tokens_at = [int(token) for token in rest[: num_drafted + 1]]
        token_at, rest = tokens_at.__getitem__, rest[num_drafted + 1 :]
    draft_ids = ()
    if draft_tokens is not None:
        draft_ids, rest = tuple(int(token) for token in rest[:num_drafted]), rest[num_drafted:]
    block_length = num_drafted
    if length is not None:
        num_drafted, rest = int(rest[0]), rest[1:]
    position_features = None
    if features:
        position_features = {
            name: tuple(rest[i * block_length : i * block_length + num_drafted])
            for i, name in enumerate(features)
        }
    device_tokens = None
    if isinstance(next_token, torch.Tensor) and draft_tokens is not None:
        device_tokens = (draft_tokens, next_token)
    if length is not None:
        accepted_at, candidate_at, loose_at = (
            x[:num_drafted] for x in (accepted_at, candidate_at, loose_at)
        )
    num_kept = first_unkept([a or b for a, b in zip(accepted_at, loose_at, strict=True)])
    loose_positions = tuple(i for i in range(num_kept) if loose_at[i])
    need = 0
    if fly is not None and fly.defer:
        need = deferred_need(accepted_at, candidate_at, cut=num_kept, window=fly.window)
    if need:
        return Verdict(
            num_drafted=num_drafted,
            num_kept=num_drafted,
            loose_positions=loose_positions,
            next_token=token_at(num_drafted),
            deferral=Deferral(position=num_kept, need=need, correction=token_at(num_kept)),
            draft_ids=draft_ids,
            device_tokens=device_tokens,
            position_features=position_features,
        )
    return Verdict(
        num_drafted=num_drafted,
        num_kept=num_kept,
        loose_positions=loose_positions,
        next_token=token_at(num_kept),
        draft_ids=draft_ids,
        device_tokens=device_tokens,
        position_features=position_features,
    )


# --------------------------------------------------------------------------- temperature 0


def verify_greedy(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    fly: FlyConfig | None,
    draft_confidence: torch.Tensor | None = None,
    end_tokens: torch.Tensor | None = None,
) -> Verdict:
    """Greedy verification (temperature 0), exact or FLy.

    ``draft_tokens``: ``long[K]``; ``target_logits``: ``[K+1, V]``; ``draft_confidence``:
    ``float[K]`` or None (:func:`draft_unsure`). With ``fly=None`` the result is lossless: the
    emitted tokens are exactly the target's greedy tokens. ``end_tokens`` ``long[E]``: the
    block ends after its first end token, as if drafted no further (a drafter that did not
    read its block could not cut it there); the verdict's ``num_drafted`` says where.
    """
    num_drafted = draft_tokens.shape[0]
    target_tokens = greedy_tokens(target_logits)  # [K+1]
    if num_drafted == 0:  # the target alone: its token, one read
        return Verdict(0, 0, (), int(target_tokens[0]), device_tokens=(draft_tokens, target_tokens))
    accepted = draft_tokens == target_tokens[:num_drafted]  # [K]
    length = in_block = None
    if end_tokens is not None:
        ends = torch.isin(draft_tokens, end_tokens)  # [K]
        # Where the first end token is, plus one; K without one.
        length = torch.where(ends.any(), ends.int().argmax() + 1, num_drafted).reshape(1)
        in_block = torch.arange(num_drafted, device=accepted.device) < length  # [K]
        accepted &= in_block
    candidates = torch.zeros_like(accepted)
    features = None
    if fly is not None:
        block_logits = target_logits[:num_drafted]
        features = loose_token_features(block_logits, draft_tokens, entropy=fly.entropy)
        possible = block_logits.gather(1, draft_tokens[:, None]).squeeze(1) > -math.inf
        candidates = loosening_candidates(
            accepted,
            block_logits,
            draft_tokens,
            possible,
            fly=fly,
            draft_confidence=draft_confidence,
            entropy=features["entropy"],
        )
        if in_block is not None:
            candidates &= in_block
        if draft_confidence is not None:
            features["draft_confidence"] = draft_confidence.to(block_logits.device)
    return _verdict(
        accepted=accepted,
        candidates=candidates,
        next_token=target_tokens,
        fly=fly,
        draft_tokens=draft_tokens,
        length=length,
        features=features,
    )


# --------------------------------------------------------------------------- temperature > 0


def sampling_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The logits the target samples from: temperature, then top-k, then top-p, with -inf
    outside top-k / top-p. ``[..., V]``. Requires ``sampling.temperature > 0``.

    FLy's gate and plausibility floor read these at T > 0, as vLLM's own FLy and its plugin
    do (docs/design.md, "Which logits the rule reads")."""
    scaled = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth_largest = scaled.topk(sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, -math.inf)
    if sampling.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_above >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, -math.inf)
    return scaled


def sampling_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities the target samples from (the softmax of :func:`sampling_logits`):
    ``[..., V]``, 0 outside top-k / top-p."""
    return sampling_logits(logits, sampling).softmax(dim=-1)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    *,
    fly: FlyConfig | None,
    target_logits: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    draft_confidence: torch.Tensor | None = None,
) -> Verdict:
    """Lossless speculative sampling, optionally loosened by FLy.

    ``draft_tokens``: ``long[K]``; ``draft_probs``: ``[K, V]`` the distributions the draft
    sampled from, or None for a deterministic (greedy or n-gram) draft, i.e. one-hot;
    ``target_probs``: ``[K+1, V]``, the softmax of ``target_logits``; ``target_logits``: the
    ``[K+1, V]`` logits the target samples from (:func:`sampling_logits`), which FLy's gate
    and floor read (needed when ``fly`` is set);
    ``draft_confidence``: ``float[K]`` or None (:func:`draft_unsure`).

    Position ``i`` is accepted with probability ``min(1, target/draft)`` at the draft token;
    FLy then loosely keeps some rejected positions, never one outside the target's top-k /
    top-p (a logit of -inf; a finite logit whose probability underflows to 0 may be kept).
    At the cut the correction is sampled from ``normalise(max(0, target - draft))``.
    """
    num_drafted = draft_tokens.shape[0]
    positions = torch.arange(num_drafted, device=draft_tokens.device)
    target_at_draft = target_probs[positions, draft_tokens]  # [K]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs[positions, draft_tokens]
    uniforms = torch.rand(num_drafted, generator=generator, device=target_probs.device)
    accepted = speculative_acceptance(target_at_draft, draft_at_draft, uniforms)  # [K]

    candidates = torch.zeros_like(accepted)
    if fly is not None and num_drafted:
        if target_logits is None:
            raise ValueError("target_logits are needed for the FLy entropy gate")
        candidates = loosening_candidates(
            accepted,
            target_logits[:num_drafted],
            draft_tokens,
            target_logits[positions, draft_tokens] > -math.inf,
            fly=fly,
            draft_confidence=draft_confidence,
        )

    def next_token_at(cut: int) -> int:
        if cut == num_drafted:
            return int(torch.multinomial(target_probs[cut], 1, generator=generator))
        return sample_correction(
            target_probs[cut],
            None if draft_probs is None else draft_probs[cut],
            draft_token=draft_tokens[cut],
            generator=generator,
        )

    return _verdict(accepted=accepted, candidates=candidates, next_token=next_token_at, fly=fly)


def sample_correction(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    *,
    draft_token: int | torch.Tensor,
    generator: torch.Generator | None = None,
) -> int:
    """Sample from ``normalise(max(0, target - draft))`` at a rejected position: ``[V] -> id``.

    ``draft_probs=None`` means a one-hot draft at ``draft_token`` (an id, or a ``long[]``
    tensor on the device, which is not read).
    """
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    # No residual mass is only reachable through rounding: then the target's own distribution.
    residual = torch.where(residual.sum() > 0, residual, target_probs)
    return int(torch.multinomial(residual, 1, generator=generator))
