"""The paper's rule against a plain statement of it, over every block of up to 10 positions,
and the lossless sampler against the target's joint distribution over several positions."""

import itertools
import math

import pytest
import torch

from flyspec.config import FlyConfig, SamplingConfig
from flyspec.decoding.verify import sampling_probs, verify_greedy, verify_sampling
from flyspec.testing.conformance import loose_acceptance, num_leading_kept

# --------------------------------------------------------------------------- oracle

MATCH, UNSURE_MISMATCH, SURE_MISMATCH = 0, 1, 2
THETA = 0.3


def oracle_kept(pattern: tuple[int, ...], window: int) -> list[bool]:
    """The rule as the paper states it, position by position: a position is kept when the
    draft matched, or when it mismatched where the target was unsure and each of the next
    ``window`` positions exists in the block and matched."""
    kept = []
    for i, kind in enumerate(pattern):
        if kind == MATCH:
            kept.append(True)
        elif kind == SURE_MISMATCH:
            kept.append(False)
        else:
            following = pattern[i + 1 : i + 1 + window]
            kept.append(len(following) == window and all(k == MATCH for k in following))
    return kept


def every_block(num_drafted: int) -> list[tuple[int, ...]]:
    return list(itertools.product((MATCH, UNSURE_MISMATCH, SURE_MISMATCH), repeat=num_drafted))


@pytest.mark.parametrize("window", [0, 1, 2, 3, 6])
def test_loose_acceptance_matches_the_oracle_on_every_block_up_to_ten(window):
    """All 3^K blocks of each length K <= 10 in one flattened batch per K, so the batched
    form (the one vLLM's sampler calls) is what is checked, block bounds included."""
    for num_drafted in range(1, 11):
        patterns = every_block(num_drafted)
        flat = torch.tensor(patterns, dtype=torch.long).flatten()
        accepted = flat == MATCH
        entropy = torch.where(flat == UNSURE_MISMATCH, 0.7, 0.01)
        cu_num_drafted = torch.arange(1, len(patterns) + 1) * num_drafted
        loose = loose_acceptance(
            accepted, entropy, window=window, theta=THETA, cu_num_drafted=cu_num_drafted
        )
        kept = (accepted | loose).view(len(patterns), num_drafted)
        expected = torch.tensor([oracle_kept(p, window) for p in patterns])
        mismatch = (kept != expected).any(dim=1).nonzero().flatten()
        assert mismatch.numel() == 0, f"K={num_drafted}: {patterns[int(mismatch[0])]}"
        # The verdict's cut: the first position kept by neither rule.
        leading = num_leading_kept(accepted | loose, cu_num_drafted)
        assert leading.tolist() == expected.long().cumprod(dim=1).sum(dim=1).tolist()


def greedy_block(pattern: tuple[int, ...], vocab: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens ``long[K]`` and target logits ``[K+1, V]`` for a pattern: the target's
    token is 0 everywhere; a mismatch drafts 1; an unsure row splits 0 and 2."""
    drafts = torch.tensor([0 if kind == MATCH else 1 for kind in pattern], dtype=torch.long)
    logits = torch.full((len(pattern) + 1, vocab), -30.0)
    logits[:, 0] = 30.0
    for i, kind in enumerate(pattern):
        if kind == UNSURE_MISMATCH:
            logits[i, 0] = logits[i, 2] = logits[i, 1] = 1.0
    return drafts, logits


@pytest.mark.parametrize("window", [1, 3])
def test_verdict_invariants_on_every_block_up_to_seven(window):
    """Loose positions are rejected positions before the cut, the cut is the first position
    kept by neither rule, and FLy keeps at least as many tokens as exact verification."""
    fly = FlyConfig(window=window, theta=THETA)
    for num_drafted in range(0, 8):
        for pattern in every_block(num_drafted):
            drafts, logits = greedy_block(pattern)
            loose = verify_greedy(drafts, logits, fly=fly)
            exact = verify_greedy(drafts, logits, fly=None)
            kept = oracle_kept(pattern, window)
            cut = next((i for i, k in enumerate(kept) if not k), num_drafted)
            assert loose.num_kept == cut, pattern
            assert all(pattern[i] != MATCH and i < loose.num_kept for i in loose.loose_positions)
            assert loose.num_kept >= exact.num_kept
            assert exact.loose_positions == ()
            assert loose.next_token == exact.next_token == 0  # the target's token
            first_mismatch = next((i for i, k in enumerate(pattern) if k != MATCH), num_drafted)
            assert exact.num_kept == first_mismatch
            assert loose.num_loose == sum(k != MATCH for k in pattern[: loose.num_kept])


# --------------------------------------------------------------------------- distribution

VOCAB = 4
LENGTH = 3  # the joint distribution of the first LENGTH emitted tokens, VOCAB**LENGTH cells
TRIALS = 4000


def prefix_dependent_logits(seed: int) -> torch.Tensor:
    """``[VOCAB, VOCAB]``: row ``t`` is the next-token logits after token ``t``."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.2


def joint_of_first_tokens(
    *,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    sampling: SamplingConfig,
    num_drafted: int,
    one_hot_draft: bool,
    fly: FlyConfig | None,
    seed: int,
) -> torch.Tensor:
    """Counts ``[VOCAB**LENGTH]`` of the first LENGTH tokens emitted by speculative decoding
    from token 0: draft ``num_drafted`` tokens (sampled from the draft, or its argmax), verify
    against the target's sampling distribution given each prefix, commit, repeat."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = sampling_probs(target_logits, sampling)  # [VOCAB, VOCAB], row = previous
    draft_probs = sampling_probs(draft_logits, sampling)
    counts = torch.zeros(VOCAB**LENGTH)
    for _ in range(TRIALS):
        emitted: list[int] = []
        last = 0
        while len(emitted) < LENGTH:
            drafted, rows = [], []
            previous = last
            for _ in range(num_drafted):
                if one_hot_draft:
                    token = int(draft_probs[previous].argmax())
                else:
                    token = int(torch.multinomial(draft_probs[previous], 1, generator=generator))
                drafted.append(token)
                rows.append(previous)
                previous = token
            rows.append(previous)
            verdict = verify_sampling(
                torch.tensor(drafted, dtype=torch.long),
                None if one_hot_draft else draft_probs[rows[:-1]],
                target_probs[rows],
                fly=fly,
                target_logits=target_logits[rows],
                generator=generator,
            )
            emitted += drafted[: verdict.num_kept] + [verdict.next_token]
            last = emitted[-1]
        cell = 0
        for token in emitted[:LENGTH]:
            cell = cell * VOCAB + token
        counts[cell] += 1
    return counts


def expected_joint(target_logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The target's own probability of each sequence of LENGTH tokens after token 0."""
    probs = sampling_probs(target_logits, sampling)
    joint = torch.zeros(VOCAB**LENGTH)
    for sequence in itertools.product(range(VOCAB), repeat=LENGTH):
        p, previous, cell = 1.0, 0, 0
        for token in sequence:
            p *= float(probs[previous, token])
            previous, cell = token, cell * VOCAB + token
        joint[cell] = p
    return joint


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``expected_probs`` over the cells the target can
    produce. A count in a cell of probability 0 is an outright failure (p = 0)."""
    possible = expected_probs > 0
    if counts[~possible].sum() > 0:
        return 0.0
    expected = expected_probs[possible] * counts.sum()
    statistic = float(((counts[possible] - expected) ** 2 / expected).sum())
    degrees = int(possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2), torch.tensor(statistic / 2)))


SAMPLINGS = {
    "plain": SamplingConfig(temperature=1.0),
    "top-k 3, top-p 0.9": SamplingConfig(temperature=0.8, top_k=3, top_p=0.9),
}


@pytest.mark.parametrize("num_drafted", [1, 3, 5])
@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["sampled", "one-hot"])
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_speculative_sampling_keeps_the_targets_joint_distribution(
    num_drafted, one_hot_draft, sampling
):
    target_logits = prefix_dependent_logits(seed=1)
    draft_logits = prefix_dependent_logits(seed=2)
    counts = joint_of_first_tokens(
        target_logits=target_logits,
        draft_logits=draft_logits,
        sampling=sampling,
        num_drafted=num_drafted,
        one_hot_draft=one_hot_draft,
        fly=None,
        seed=10 * num_drafted + one_hot_draft,
    )
    p_value = chi_square_p_value(counts, expected_joint(target_logits, sampling))
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"


def test_the_chi_square_check_can_tell_a_loosened_distribution_apart():
    """FLy with W=0 and no entropy bar keeps every draft token the target allows, so the
    emitted distribution is the draft's: the same check must reject it."""
    sampling = SAMPLINGS["plain"]
    target_logits = prefix_dependent_logits(seed=1)
    counts = joint_of_first_tokens(
        target_logits=target_logits,
        draft_logits=prefix_dependent_logits(seed=2),
        sampling=sampling,
        num_drafted=3,
        one_hot_draft=False,
        fly=FlyConfig(window=0, theta=0.0),
        seed=7,
    )
    assert chi_square_p_value(counts, expected_joint(target_logits, sampling)) < 1e-6


def test_chi_square_p_value_of_an_exact_fit_is_one():
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert chi_square_p_value(torch.tensor([50.0, 25.0, 25.0, 0.0]), probs) == pytest.approx(1.0)
    assert chi_square_p_value(torch.tensor([50.0, 25.0, 24.0, 1.0]), probs) == 0.0
    assert math.isclose(
        chi_square_p_value(torch.tensor([60.0, 20.0, 20.0, 0.0]), probs),
        math.exp(-4 / 2),  # statistic 4 with 2 degrees of freedom: p = exp(-x/2)
        rel_tol=1e-5,
    )
