"""The engine-independent conformance batches (no vLLM needed)."""

import math
from collections import Counter

import pytest
import torch

from flyspec.decoding.verify import verify_greedy
from flyspec.testing.conformance import (
    KINDS,
    ConformanceBatch,
    compare,
    coverage,
    expected_decisions,
    random_batch,
    vllm_emitted,
    vllm_rejection_inputs,
)

FAR = -1.0e4


def batch_of(drafts, rows, greedy, *, window=1, theta=0.3) -> ConformanceBatch:
    return ConformanceBatch(
        draft_tokens=tuple(torch.tensor(d, dtype=torch.long) for d in drafts),
        target_logits=tuple(torch.tensor(r, dtype=torch.float32) for r in rows),
        greedy=tuple(greedy),
        temperature=tuple(0.0 if g else 1.0 for g in greedy),
        kinds=tuple(("hand-made",) * len(d) for d in drafts),
        window=window,
        theta=theta,
    )


UNSURE = [0.0, -0.1, -0.2, -5.0]  # argmax 0, top-3 entropy ~1.1


def test_hand_made_batch():
    """Greedy: a loose keep whose window holds, then a cut at a sure mismatch; a zero-draft
    request; sampled: a loose keep, then a cut at a placeholder."""
    sure = [-9.0, 0.0, -9.0, -9.0]  # argmax 1, entropy ~ 0
    greedy_rows = [UNSURE, sure, [-9.0, -9.0, 0.0, -9.0], [-9.0, -9.0, -9.0, 0.0]]
    unsure_sampled = [0.0, -0.1, -0.2, -45.0]
    point = [FAR, FAR, 0.0, FAR]
    batch = batch_of(
        [[2, 1, 1], [], [3, 2, -1]],
        [greedy_rows, [[0.0, -1.0, -2.0, -3.0]], [unsure_sampled, point, UNSURE, point]],
        [True, True, False],
    )
    greedy, empty, sampled = expected_decisions(batch)
    assert greedy.tokens == (2, 1, 2) and greedy.loose_positions == (0,)
    assert empty.tokens == (0,) and empty.num_kept == 0
    assert sampled.tokens is None and sampled.kept_tokens == (3, 2)
    assert sampled.loose_positions == (0,) and sampled.next_token_support == (0, 1, 2, 3)
    assert not compare(batch, expected_decisions(batch), [[2, 1, 2], [0], [3, 2, 1]])
    found = compare(batch, expected_decisions(batch), [[1, 1, 2], [0], [3, 1, 0]])
    assert [m.request for m in found] == [0, 2]
    assert "request 0" in str(found[0])


def test_window_must_fit_and_hold():
    """An unsure mismatch in the last W positions is not kept; nor one with a second
    mismatch inside its window."""
    match0 = [0.0, -9.0, -9.0, -9.0]
    rows = [UNSURE, match0, match0]
    batch = batch_of([[1, 0]], [rows], [True], window=2)
    assert expected_decisions(batch)[0].num_kept == 0
    batch = batch_of([[1, 1, 0]], [[UNSURE, UNSURE, match0, match0]], [True], window=1)
    assert expected_decisions(batch)[0].num_kept == 0


def test_narrow_row_uses_the_fixed_entropy():
    """A greedy row masked to two tokens: entropy ~ ln 2 (not NaN), so the mismatch is kept."""
    inf = -math.inf
    rows = [[0.0, -0.1, inf, inf], [inf, 0.0, inf, inf], [0.0, inf, inf, inf]]
    assert expected_decisions(batch_of([[1, 1]], [rows], [True]))[0].tokens == (1, 1, 0)


def test_sampled_acceptance_must_not_depend_on_the_draw():
    rows = [[0.0, -1.0, -2.0, -3.0], [0.0, -1.0, -2.0, -3.0]]
    with pytest.raises(ValueError, match="random draw"):
        expected_decisions(batch_of([[1]], [rows], [False]))


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_random_batches_cover_every_case(mode):
    covered: Counter = Counter()
    for seed in range(40):
        batch = random_batch(torch.Generator().manual_seed(seed), mode=mode)
        covered += coverage(batch)
        assert all(len(k) == n for k, n in zip(batch.kinds, batch.num_drafted, strict=True))
    cases = [*KINDS, "zero_drafts", "narrow_rows", "loose"]
    cases += ["window_holds", "window_breaks", "window_does_not_fit"]
    if mode == "mixed":
        cases += ["greedy", "sampled", "mixed_batches"]
    else:
        cases += [mode]
    assert [case for case in cases if covered[case] == 0] == []


def test_greedy_decisions_match_verify_greedy():
    """Without placeholders the batched rule is flyspec's per-block greedy verdict."""
    for seed in range(30):
        batch = random_batch(torch.Generator().manual_seed(seed), mode="greedy")
        for r, decision in enumerate(expected_decisions(batch)):
            drafts = batch.draft_tokens[r]
            if bool((drafts < 0).any()):
                continue
            verdict = verify_greedy(drafts, batch.target_logits[r], fly=batch.fly)
            assert decision.num_kept == verdict.num_kept
            assert decision.loose_positions == verdict.loose_positions
            assert decision.tokens[-1] == verdict.next_token


def test_vllm_layout():
    batch = batch_of([[2, 1], [], [3]], [[UNSURE] * 3, [UNSURE], [UNSURE] * 2], [True, False, True])
    inputs = vllm_rejection_inputs(batch, seed=1)
    assert inputs["cu_num_logits"].tolist() == [0, 3, 4, 6]
    assert inputs["target_logits"].shape == (6, 4)
    drafts = inputs["draft_sampled"].tolist()
    assert drafts[1:3] == [2, 1] and drafts[5] == 3
    assert inputs["expanded_local_pos"].tolist() == [0, 1, 2, 0, 0, 1]
    slots = inputs["idx_mapping"].tolist()
    assert inputs["expanded_idx_mapping"].tolist() == [slots[0]] * 3 + [slots[1]] + [slots[2]] * 2
    assert inputs["temperature"][slots].tolist() == [0.0, 1.0, 0.0]
    assert inputs["num_speculative_steps"] == 2
    sampled = torch.tensor([[2, 1, 0], [3, 9, 9], [3, 0, 9]])
    assert vllm_emitted(sampled, torch.tensor([3, 1, 2])) == [[2, 1, 0], [3], [3, 0]]
