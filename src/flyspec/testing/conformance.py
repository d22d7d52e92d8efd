"""Engine-independent conformance batches for FLy's verification rule, and the batched
statements of the rule they are decided with.

A :class:`ConformanceBatch` is a random ragged batch of draft blocks with the target logits an
engine verifies them with; :func:`expected_decisions` is what flyspec's rule
(:mod:`flyspec.decoding.verify`) makes of it, request by request. An engine's verification
(vLLM 0.34's built-in FLy, or flyspec's vLLM plugin) run on the same batch must emit the same
tokens; :func:`compare` lists where it does not.

Sampled requests are built so that their decisions do not depend on the engine's random
draws: every drafted token is one-hot (the draft is deterministic), and the target gives it
either probability 1 (accepted for every uniform draw ``u < 1``) or at most ``e^-40`` (rejected
for every draw ``u >= 2^-32``). Only the token drawn at the cut (the correction, or the bonus)
is random; :class:`Decision` gives the set it may come from.

No vLLM import here: adapters only reshape tensors into an engine's layout.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flyspec.config import FlyConfig
from flyspec.decoding.verify import (
    kept_prefix,
    loosely_accepted,
    request_of_positions,
    speculative_acceptance,
    top3_entropy,
    window_holds,
)

MIN_UNIFORM = 2.0**-32  # the smallest uniform draw a 32-bit generator gives (0 excluded)
MAX_UNIFORM = 1.0 - 2.0**-24  # the largest float32 below 1
REJECTED_LOGIT = -45.0  # a rejected sampled draft token, relative to a top logit near 0
FAR_LOGIT = -1.0e4  # the other finite tokens of a row that puts probability 1 on one token
ENTROPY_MARGIN = 0.05  # uncertain and certain rows keep at least this far from theta

# The kinds of drafted positions random_batch builds (see _position_row).
KINDS = (
    "match",  # the draft token is the target's (greedy: argmax; sampled: probability 1)
    "uncertain_miss",  # rejected; the target is unsure (entropy >= theta) and allows the token
    "certain_miss",  # rejected; the target is sure (entropy < theta)
    "masked_miss",  # rejected; the draft token is masked (-inf), the target is unsure
    "narrow_match",  # accepted on a row masked to fewer than 3 finite logits
    "narrow_miss",  # rejected on a row masked to fewer than 3 finite logits
    "placeholder",  # a -1 draft id (no draft token)
)


@dataclass(frozen=True)
class ConformanceBatch:
    """A ragged batch of draft blocks in flyspec's terms.

    Request ``r`` drafted ``draft_tokens[r]`` (``long[K_r]``, ``-1`` for a placeholder) and is
    verified with ``target_logits[r]`` (``float32[K_r + 1, V]``, the processed logits the
    engine verifies with: temperature, top-k and allowed-token masks already applied; the last
    row gives the bonus token). ``greedy[r]`` requests run at temperature 0; the others at
    ``temperature[r]`` with one-hot drafts. ``kinds[r]`` names how each position was built
    (:data:`KINDS`). ``window`` and ``theta`` are FLy's settings (top-3 entropy gate).
    """

    draft_tokens: tuple[torch.Tensor, ...]
    target_logits: tuple[torch.Tensor, ...]
    greedy: tuple[bool, ...]
    temperature: tuple[float, ...]
    kinds: tuple[tuple[str, ...], ...]
    window: int
    theta: float

    @property
    def num_requests(self) -> int:
        return len(self.draft_tokens)

    @property
    def vocab_size(self) -> int:
        return int(self.target_logits[0].shape[-1])

    @property
    def num_drafted(self) -> list[int]:
        return [int(tokens.shape[0]) for tokens in self.draft_tokens]

    @property
    def fly(self) -> FlyConfig:
        return FlyConfig(window=self.window, theta=self.theta)

    def cu_num_drafted(self) -> torch.Tensor:
        """Inclusive cumulative draft counts, as :mod:`flyspec.decoding.verify` takes them:
        ``long[B]``."""
        return torch.tensor(self.num_drafted, dtype=torch.long).cumsum(0)


@dataclass(frozen=True)
class Decision:
    """flyspec's decision on one request.

    ``num_kept`` drafted tokens are emitted (``loose_positions`` of them kept loosely), then
    one more token: exactly ``tokens[-1]`` for a greedy request (``tokens`` is the whole
    emission), or any of ``next_token_support`` for a sampled one (``tokens`` is None).
    """

    num_kept: int
    loose_positions: tuple[int, ...]
    kept_tokens: tuple[int, ...]
    tokens: tuple[int, ...] | None
    next_token_support: tuple[int, ...]


@dataclass(frozen=True)
class Mismatch:
    """One request whose emitted tokens differ from flyspec's decision."""

    request: int
    expected: str
    got: str

    def __str__(self) -> str:
        return f"request {self.request}: expected {self.expected}, got {self.got}"


# --------------------------------------------------------------------------- random batches


def _uniform(generator: torch.Generator, low: float, high: float, n: int = 1) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator)


def _choice(generator: torch.Generator, options: Sequence):
    return options[int(torch.randint(len(options), (1,), generator=generator))]


def _others(generator: torch.Generator, vocab_size: int, exclude: Sequence[int], n: int):
    """``n`` distinct token ids not in ``exclude``: ``long[n]``."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[list(exclude)] = False
    pool = keep.nonzero().flatten()
    return pool[torch.randperm(pool.shape[0], generator=generator)[:n]]


def _spread(generator: torch.Generator, vocab_size: int, top: int, *, masked: int | None = None):
    """A high-entropy row whose unique argmax is ``top``: ``float32[V]``. Some of the other
    tokens are masked to -inf (as top-k would), and ``masked`` is always among them."""
    row = -2.0 - 3.0 * torch.rand(vocab_size, generator=generator)
    num_high = int(torch.randint(2, 5, (1,), generator=generator))
    high = _others(
        generator, vocab_size, [top] + ([masked] if masked is not None else []), num_high
    )
    row[high] = _uniform(generator, -0.6, -0.05, num_high)
    row[top] = 0.0
    num_masked = int(torch.randint(0, vocab_size // 4, (1,), generator=generator))
    row[_others(generator, vocab_size, [top, *high.tolist()], num_masked)] = -math.inf
    if masked is not None:
        row[masked] = -math.inf
    return row


def _peaked(generator: torch.Generator, vocab_size: int, top: int) -> torch.Tensor:
    """A near-certain row whose argmax is ``top`` (entropy ~ 1e-4): ``float32[V]``."""
    row = -12.0 - 4.0 * torch.rand(vocab_size, generator=generator)
    row[top] = 0.0
    return row


def _point_mass(vocab_size: int, token: int, generator: torch.Generator) -> torch.Tensor:
    """Probability 1 (in float32) on ``token``; the other tokens far below or masked."""
    row = torch.full((vocab_size,), FAR_LOGIT) - torch.rand(vocab_size, generator=generator)
    row[torch.rand(vocab_size, generator=generator) < 0.3] = -math.inf
    row[token] = 0.0
    return row


def _position_row(
    generator: torch.Generator, kind: str, *, greedy: bool, vocab_size: int
) -> tuple[int, torch.Tensor]:
    """The draft id and target row ``float32[V]`` of one drafted position of ``kind``."""
    top, draft = _others(generator, vocab_size, [], 2).tolist()
    if kind == "match":
        if greedy:
            unsure = bool(torch.rand(1, generator=generator) < 0.5)
            row = (
                _spread(generator, vocab_size, top)
                if unsure
                else _peaked(generator, vocab_size, top)
            )
            return top, row
        return top, _point_mass(vocab_size, top, generator)
    if kind == "uncertain_miss":
        row = _spread(generator, vocab_size, top)
        if greedy:
            row[draft] = float(_uniform(generator, -0.6, -0.05))
        else:
            row[draft] = REJECTED_LOGIT
        return draft, row
    if kind == "certain_miss":
        row = _peaked(generator, vocab_size, top)
        row[draft] = REJECTED_LOGIT if not greedy else -12.0
        return draft, row
    if kind == "masked_miss":
        return draft, _spread(generator, vocab_size, top, masked=draft)
    if kind == "narrow_match":
        row = torch.full((vocab_size,), -math.inf)
        if greedy:
            row[top] = 0.0
            row[draft] = float(_uniform(generator, -0.6, -0.05))
        else:
            row[top] = 0.0
            if bool(torch.rand(1, generator=generator) < 0.5):
                row[draft] = FAR_LOGIT
        return top, row
    if kind == "narrow_miss":
        row = torch.full((vocab_size,), -math.inf)
        row[top] = 0.0
        finite_draft = bool(torch.rand(1, generator=generator) < 0.75)
        if finite_draft:  # greedy: two near-equal tokens (entropy ~ ln 2); sampled: sure
            row[draft] = float(_uniform(generator, -0.6, -0.05)) if greedy else REJECTED_LOGIT
        return draft, row
    if kind == "placeholder":
        return -1, _spread(generator, vocab_size, top)
    raise ValueError(f"unknown position kind {kind!r}")


def _bonus_row(generator: torch.Generator, *, greedy: bool, vocab_size: int) -> torch.Tensor:
    top = int(torch.randint(vocab_size, (1,), generator=generator))
    if greedy or bool(torch.rand(1, generator=generator) < 0.5):
        return _spread(generator, vocab_size, top)
    return _point_mass(vocab_size, top, generator)


def _kind_pattern(generator: torch.Generator, num_drafted: int, window: int) -> list[str]:
    """Position kinds of one block: mostly matches, with mismatches whose windows hold, break
    (a second mismatch inside) or do not fit, and now and then trailing placeholders."""
    weights = torch.tensor([0.55, 0.2, 0.06, 0.05, 0.05, 0.05, 0.04])
    if num_drafted == 0:
        return []
    picks = torch.multinomial(weights, num_drafted, replacement=True, generator=generator)
    kinds = [KINDS[int(i)] for i in picks]
    if num_drafted > window and bool(torch.rand(1, generator=generator) < 0.5):
        start = int(torch.randint(num_drafted - window, (1,), generator=generator))
        kinds[start] = "uncertain_miss"
        for j in range(start + 1, start + window + 1):
            kinds[j] = "match"
        if bool(torch.rand(1, generator=generator) < 0.3):
            kinds[start + int(torch.randint(1, window + 1, (1,), generator=generator))] = (
                "uncertain_miss"
            )
    if bool(torch.rand(1, generator=generator) < 0.1):
        num_tail = int(torch.randint(1, num_drafted + 1, (1,), generator=generator))
        kinds[num_drafted - num_tail :] = ["placeholder"] * num_tail
    return kinds


def random_batch(
    generator: torch.Generator,
    *,
    mode: str = "mixed",
    num_requests: int | None = None,
    max_drafted: int = 8,
    vocab_size: int | None = None,
    window: int | None = None,
    theta: float | None = None,
) -> ConformanceBatch:
    """A random ragged batch whose FLy decisions do not depend on the engine's random draws.

    ``mode``: ``"greedy"``, ``"sampled"`` or ``"mixed"``. Unset sizes and settings are drawn:
    1-5 requests, 0-``max_drafted`` drafts each, V in 16-64, window 1-3, theta 0.3 or 0.5.
    Sampled requests get a temperature in {0.6, 1.0, 1.3}: the logits are the processed ones,
    so the temperature only tells the engine that the request samples.
    """
    if mode not in ("greedy", "sampled", "mixed"):
        raise ValueError(f"mode must be greedy, sampled or mixed, got {mode!r}")
    if num_requests is None:
        num_requests = int(torch.randint(1, 6, (1,), generator=generator))
    if vocab_size is None:
        vocab_size = int(torch.randint(16, 65, (1,), generator=generator))
    if window is None:
        window = int(torch.randint(1, 4, (1,), generator=generator))
    if theta is None:
        theta = _choice(generator, (0.3, 0.5))
    drafts, logits, greedy_flags, temperatures, all_kinds = [], [], [], [], []
    for r in range(num_requests):
        greedy = mode == "greedy" or (mode == "mixed" and r % 2 == 0)
        if mode == "mixed" and bool(torch.rand(1, generator=generator) < 0.3):
            greedy = not greedy
        num_drafted = int(torch.randint(0, max_drafted + 1, (1,), generator=generator))
        kinds = _kind_pattern(generator, num_drafted, window)
        rows, tokens = [], []
        for kind in kinds:
            token, row = _position_row(generator, kind, greedy=greedy, vocab_size=vocab_size)
            tokens.append(token)
            rows.append(row)
        rows.append(_bonus_row(generator, greedy=greedy, vocab_size=vocab_size))
        drafts.append(torch.tensor(tokens, dtype=torch.long))
        logits.append(torch.stack(rows).float())
        greedy_flags.append(greedy)
        temperatures.append(0.0 if greedy else _choice(generator, (0.6, 1.0, 1.3)))
        all_kinds.append(tuple(kinds))
    batch = ConformanceBatch(
        draft_tokens=tuple(drafts),
        target_logits=tuple(logits),
        greedy=tuple(greedy_flags),
        temperature=tuple(temperatures),
        kinds=tuple(all_kinds),
        window=window,
        theta=float(theta),
    )
    check_margins(batch)
    return batch


def check_margins(batch: ConformanceBatch) -> None:
    """Raise ValueError where a decision could flip on rounding: an entropy within
    :data:`ENTROPY_MARGIN` of theta, or a tie for a greedy row's top token."""
    for r, logits in enumerate(batch.target_logits):
        entropy = top3_entropy(logits)
        close = (entropy - batch.theta).abs() < ENTROPY_MARGIN
        if bool(close.any()):
            raise ValueError(f"request {r}: entropy within the margin of theta at {close}")
        if batch.greedy[r]:
            top2 = logits.topk(min(2, logits.shape[-1]), dim=-1).values
            if bool((top2[:, 0] == top2[:, -1]).any()) and logits.shape[-1] > 1:
                raise ValueError(f"request {r}: tied top logits")


# --------------------------------------------------------------------------- flyspec's rule


def loose_acceptance(
    accepted: torch.Tensor,
    entropy: torch.Tensor,
    *,
    window: int,
    theta: float,
    cu_num_drafted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which rejected positions the paper's rule keeps loosely: ``bool[T], float[T] -> bool[T]``.

    A rejected position ``i`` is kept when the target is unsure there (``entropy[i] >= theta``)
    and the next ``window`` positions ``i+1 .. i+window`` are all accepted, which requires the
    window to fit in the block (:func:`~flyspec.decoding.verify.window_holds`). A second rejection
    inside the window means the target is correcting a real error, so the first one stays
    rejected.
    """
    holds = window_holds(accepted, window=window, cu_num_drafted=cu_num_drafted)
    return ~accepted & (entropy >= theta) & holds


def num_leading_kept(kept: torch.Tensor, cu_num_drafted: torch.Tensor) -> torch.Tensor:
    """Per request, how many positions of its block are kept before the first unkept one
    (the cut): ``bool[T], long[B] -> long[B]``. Vectorised, no host sync."""
    request_of = request_of_positions(cu_num_drafted, kept.shape[0])
    counts = torch.zeros(cu_num_drafted.shape[0], dtype=torch.long, device=kept.device)
    return counts.scatter_add(0, request_of, kept_prefix(kept, cu_num_drafted).long())


def native_acceptance(batch: ConformanceBatch) -> torch.Tensor:
    """Which drafted positions the target accepts without FLy, flattened: ``bool[T]``.

    Greedy: the draft token is the argmax. Sampled (one-hot drafts): speculative sampling's
    test, which must give the same answer for the smallest and the largest uniform draw.
    """
    accepted = []
    for r in range(batch.num_requests):
        drafts = batch.draft_tokens[r]
        rows = batch.target_logits[r][: drafts.shape[0]]
        valid = drafts >= 0
        if batch.greedy[r]:
            accepted.append(valid & (rows.argmax(dim=-1) == drafts))
            continue
        probs = rows.log_softmax(dim=-1).exp()
        at_draft = probs.gather(1, drafts.clamp_min(0)[:, None]).squeeze(1)
        ones = torch.ones_like(at_draft)
        low = speculative_acceptance(at_draft, ones, torch.full_like(at_draft, MIN_UNIFORM))
        high = speculative_acceptance(at_draft, ones, torch.full_like(at_draft, MAX_UNIFORM))
        if not torch.equal(low & valid, high & valid):
            raise ValueError(f"request {r}: acceptance depends on the random draw")
        accepted.append(valid & low)
    return torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.bool)


def allowed_drafts(batch: ConformanceBatch) -> torch.Tensor:
    """Where the target could emit the draft token at all (a finite verified logit, as
    :func:`flyspec.decoding.verify.verify_greedy` and
    :func:`flyspec.decoding.verify.verify_sampling` decide it), flattened: ``bool[T]``."""
    allowed = []
    for r in range(batch.num_requests):
        drafts = batch.draft_tokens[r]
        rows = batch.target_logits[r][: drafts.shape[0]]
        at_draft = rows.gather(1, drafts.clamp_min(0)[:, None]).squeeze(1)
        allowed.append((drafts >= 0) & (at_draft > -math.inf))
    return torch.cat(allowed) if allowed else torch.zeros(0, dtype=torch.bool)


def expected_decisions(batch: ConformanceBatch) -> list[Decision]:
    """flyspec's decision on every request of ``batch`` (:mod:`flyspec.decoding.verify` only)."""
    cu = batch.cu_num_drafted()
    accepted = native_acceptance(batch)
    if accepted.shape[0]:
        flat_logits = torch.cat([x[: x.shape[0] - 1] for x in batch.target_logits])
        flat_drafts = torch.cat(batch.draft_tokens)
        loose = loosely_accepted(
            accepted,
            flat_logits,
            flat_drafts.clamp_min(0),
            allowed_drafts(batch),
            fly=batch.fly,
            cu_num_drafted=cu,
        )
        kept = accepted | loose
        num_kept = num_leading_kept(kept, cu).tolist()
        loose_kept = loose & kept_prefix(kept, cu)
    else:
        num_kept = [0] * batch.num_requests
        loose_kept = accepted
    decisions = []
    for r in range(batch.num_requests):
        start = int(cu[r]) - batch.num_drafted[r]
        n = num_kept[r]
        kept_tokens = tuple(batch.draft_tokens[r][:n].tolist())
        loose_positions = tuple(
            int(i) for i in loose_kept[start : start + batch.num_drafted[r]].nonzero().flatten()
        )
        row = batch.target_logits[r][n]
        if batch.greedy[r]:
            next_token = int(row.argmax())
            decisions.append(
                Decision(n, loose_positions, kept_tokens, (*kept_tokens, next_token), (next_token,))
            )
            continue
        support = row > -math.inf
        if n < batch.num_drafted[r] and int(batch.draft_tokens[r][n]) >= 0:
            support[int(batch.draft_tokens[r][n])] = False
        support_ids = tuple(int(i) for i in support.nonzero().flatten())
        decisions.append(Decision(n, loose_positions, kept_tokens, None, support_ids))
    return decisions


def compare(
    batch: ConformanceBatch, decisions: Sequence[Decision], emitted: Sequence[Sequence[int]]
) -> list[Mismatch]:
    """Where an engine's emitted tokens (per request: the kept drafts, then one token) differ
    from ``decisions``; empty when they all agree."""
    mismatches = []
    for r, (decision, tokens) in enumerate(zip(decisions, emitted, strict=True)):
        tokens = tuple(int(t) for t in tokens)
        if decision.tokens is not None:
            if tokens != decision.tokens:
                mismatches.append(
                    Mismatch(r, _describe(batch, r, decision, decision.tokens), str(list(tokens)))
                )
            continue
        kept = tokens[:-1]
        if kept != decision.kept_tokens or not tokens:
            mismatches.append(
                Mismatch(r, _describe(batch, r, decision, decision.kept_tokens), str(list(tokens)))
            )
        elif tokens[-1] not in decision.next_token_support:
            mismatches.append(
                Mismatch(
                    r,
                    f"a last token in {list(decision.next_token_support)}",
                    f"{tokens[-1]} (emitted {list(tokens)})",
                )
            )
    return mismatches


def _describe(batch: ConformanceBatch, r: int, decision: Decision, tokens: tuple[int, ...]) -> str:
    mode = "greedy" if batch.greedy[r] else "sampled"
    what = "tokens" if decision.tokens is not None else "kept drafts"
    return (
        f"{what} {list(tokens)} ({mode}, {decision.num_kept} of {batch.num_drafted[r]} kept, "
        f"loose at {list(decision.loose_positions)}, drafts {batch.draft_tokens[r].tolist()}, "
        f"kinds {list(batch.kinds[r])}, window {batch.window}, theta {batch.theta})"
    )


def coverage(batch: ConformanceBatch, decisions: Sequence[Decision] | None = None) -> Counter:
    """The cases a batch exercises, counted: request modes, position kinds, zero-draft
    requests, rows with fewer than 3 finite logits, kept loose positions, and uncertain
    mismatches whose window holds, breaks (a second mismatch inside) or does not fit."""
    decisions = decisions if decisions is not None else expected_decisions(batch)
    accepted = native_acceptance(batch)
    counts: Counter = Counter()
    start = 0
    for r in range(batch.num_requests):
        num_drafted = batch.num_drafted[r]
        counts["greedy" if batch.greedy[r] else "sampled"] += 1
        counts["zero_drafts"] += num_drafted == 0
        counts["narrow_rows"] += int(((batch.target_logits[r] > -math.inf).sum(dim=-1) < 3).sum())
        counts["loose"] += len(decisions[r].loose_positions)
        request_accepted = accepted[start : start + num_drafted]
        for i, kind in enumerate(batch.kinds[r]):
            counts[kind] += 1
            if kind != "uncertain_miss":
                continue
            if i + batch.window > num_drafted - 1:
                counts["window_does_not_fit"] += 1
            elif bool(request_accepted[i + 1 : i + batch.window + 1].all()):
                counts["window_holds"] += 1
            else:
                counts["window_breaks"] += 1
        start += num_drafted
    counts["mixed_batches"] += len(set(batch.greedy)) == 2
    return counts


# --------------------------------------------------------------------------- engine layouts


def vllm_rejection_inputs(
    batch: ConformanceBatch, *, seed: int = 0, device: torch.device | str = "cpu"
) -> dict[str, object]:
    """The keyword arguments of vLLM 0.34's
    ``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils.rejection_sample`` for ``batch``
    (one-hot drafts, FLy on with top-3 entropy).

    Layout: request ``r`` owns logits rows ``cu_num_logits[r] .. cu_num_logits[r + 1] - 1``
    (``K_r + 1`` of them); ``draft_sampled[start + i + 1]`` is its draft token ``i`` (row
    ``start`` holds the previous token). Requests live in a request-state table larger than
    the batch, in shuffled slots (``idx_mapping``), which ``temperature`` and ``seed`` index.
    """
    generator = torch.Generator().manual_seed(seed)
    num_requests = batch.num_requests
    max_num_reqs = num_requests + 2
    slots = torch.randperm(max_num_reqs, generator=generator)[:num_requests]
    counts = torch.tensor([k + 1 for k in batch.num_drafted], dtype=torch.long)
    cu_num_logits = torch.zeros(num_requests + 1, dtype=torch.int32)
    cu_num_logits[1:] = counts.cumsum(0).to(torch.int32)
    draft_sampled = torch.cat(
        [
            torch.cat([torch.randint(batch.vocab_size, (1,), generator=generator), d])
            for d in batch.draft_tokens
        ]
    )
    positions = []
    for count in counts.tolist():
        offset = int(torch.randint(1, 1000, (1,), generator=generator))
        positions.append(torch.arange(offset, offset + count))
    temperature = torch.zeros(max_num_reqs, dtype=torch.float32)
    temperature[slots] = torch.tensor(batch.temperature, dtype=torch.float32)
    seeds = torch.randint(0, 2**62, (max_num_reqs,), generator=generator, dtype=torch.long)
    return {
        "target_logits": torch.cat(batch.target_logits).float().contiguous().to(device),
        "draft_logits_cache": None,
        "draft_sampled": draft_sampled.to(device),
        "cu_num_logits": cu_num_logits.to(device),
        "pos": torch.cat(positions).to(device),
        "idx_mapping": slots.to(torch.int32).to(device),
        "expanded_idx_mapping": slots.repeat_interleave(counts).to(torch.int32).to(device),
        "expanded_local_pos": torch.cat([torch.arange(c) for c in counts.tolist()])
        .to(torch.int32)
        .to(device),
        "temperature": temperature.to(device),
        "seed": seeds.to(device),
        "num_speculative_steps": max(batch.num_drafted),
        "fly_window_size": batch.window,
        "fly_entropy_threshold": batch.theta,
        "fly_entropy_top_k": 3,
    }


def vllm_emitted(sampled: torch.Tensor, num_sampled: torch.Tensor) -> list[list[int]]:
    """Per request, the tokens vLLM's ``rejection_sample`` emitted: ``long[B, S], int[B]``."""
    sampled = sampled.cpu()
    return [sampled[r, : int(n)].tolist() for r, n in enumerate(num_sampled.cpu())]


def vllm_v1_rejection_inputs(batch: ConformanceBatch) -> dict[str, object]:
    """The arguments of vLLM 0.32's ``rejection_sample`` (V1 model runner, which flyspec's
    plugin replaces) for ``batch``, but ``sampling_metadata``: flattened draft ids
    ``int32[T]`` and their logits ``[T, V]`` without the bonus rows, inclusive
    ``cu_num_draft_tokens`` ``int32[B]``, and the bonus rows' argmax as ``bonus_token_ids``
    ``[B, 1]`` (in the support of a sampled request's bonus row too)."""
    num_drafted = batch.num_drafted
    empty = torch.zeros(0, batch.vocab_size)
    return {
        "draft_token_ids": torch.cat([*batch.draft_tokens, torch.zeros(0, dtype=torch.long)]).to(
            torch.int32
        ),
        "num_draft_tokens": num_drafted,
        "max_spec_len": max(num_drafted),
        "cu_num_draft_tokens": batch.cu_num_drafted().to(torch.int32),
        "draft_probs": None,
        "target_logits": torch.cat([*(x[:-1] for x in batch.target_logits), empty]).float(),
        "bonus_token_ids": torch.stack([x[-1].argmax() for x in batch.target_logits])[:, None],
    }


def emitted_rows(output: torch.Tensor, placeholder: int = -1) -> list[list[int]]:
    """Per request, the tokens of an ``int[B, S]`` output padded with ``placeholder``."""
    return [[int(t) for t in row if int(t) != placeholder] for row in output.cpu()]
