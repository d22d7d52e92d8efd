"""The verification rules on synthetic logits (large +/- values make argmax and entropy exact)."""

import math
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flyspec.config import FlyConfig, SamplingConfig
from flyspec.decoding.verify import (
    greedy_tokens,
    largest_values,
    loosely_accepted,
    normalized_entropy,
    sampling_probs,
    top3_entropy,
    verify_greedy,
    verify_sampling,
)
from flyspec.testing.conformance import loose_acceptance, num_leading_kept

V = 8
SURE = 0  # rows whose target is certain (entropy ~ 0)
UNSURE = 1  # rows split evenly between two tokens (top-3 entropy = ln 2 ~ 0.69)


def logits_for(tokens: list[int], kinds: list[int] | None = None) -> torch.Tensor:
    """``[len(tokens), V]`` logits whose argmax is ``tokens[i]``; an UNSURE row puts the same
    logit on ``tokens[i]`` and on ``tokens[i] + 1`` (argmax picks the lower index)."""
    kinds = kinds or [SURE] * len(tokens)
    rows = torch.full((len(tokens), V), -30.0)
    for i, (token, kind) in enumerate(zip(tokens, kinds, strict=True)):
        rows[i, token] = 30.0
        if kind == UNSURE:
            rows[i, (token + 1) % V] = 30.0
    return rows


def draft(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


FLY = FlyConfig(window=2, theta=0.3)


class TestRowReductions:
    """The CPU's faster argmax and top-k give torch's own results, ties and masked rows
    included, over a vocabulary large enough for the chunked search."""

    VOCAB = 151_936

    def rows(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        rows = torch.randn(6, self.VOCAB, generator=generator)
        rows[1, 5] = rows[1, 70_000] = rows[1].max() + 1  # a tie for the maximum
        rows[2] = -math.inf  # a row the grammar masked but for three tokens
        rows[2, [3, 90_000, 151_935]] = torch.tensor([0.5, 2.0, 1.0])
        rows[3, 128:384] = 9.0  # the largest values all in two neighbouring chunks
        rows[4] = rows[4].round()  # many ties
        return rows

    def test_greedy_tokens_are_torchs_argmax(self):
        rows = self.rows()
        assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1))
        assert torch.equal(greedy_tokens(rows[1]), rows[1].argmax())
        assert greedy_tokens(rows[1]).shape == ()
        assert greedy_tokens(rows).dtype == torch.long
        half = rows.to(torch.bfloat16)  # torch's own path
        assert torch.equal(greedy_tokens(half), half.argmax(dim=-1))

    @pytest.mark.parametrize("k", [1, 3, 10])
    @pytest.mark.parametrize("vocab", [151_936, 151_665, 40_000])
    def test_largest_values_are_torchs_topk(self, k, vocab):
        rows = self.rows()[:, :vocab].contiguous()
        expected = rows.topk(k, dim=-1).values
        assert torch.equal(largest_values(rows, k), expected)
        assert torch.equal(largest_values(rows[None], k), expected[None])  # any leading shape

    def test_no_rows_give_no_values(self):
        # A batch whose blocks drafted nothing (prompt lookup found no match) reaches the gate
        # with no rows.
        rows = torch.empty(0, self.VOCAB)
        assert largest_values(rows, 3).shape == (0, 3)
        assert greedy_tokens(rows).shape == (0,)
        assert top3_entropy(rows).shape == (0,)


class TestEntropy:
    def test_top3_entropy_of_certain_and_split_rows(self):
        h = top3_entropy(logits_for([0, 2], [SURE, UNSURE]))
        assert h[0] == pytest.approx(0.0, abs=1e-6)
        assert h[1] == pytest.approx(math.log(2), abs=1e-6)

    def test_top3_entropy_does_not_renormalise(self):
        # Uniform over V=8: each p = 1/8, three of them: 3 * (1/8) * ln 8.
        h = top3_entropy(torch.zeros(1, V))
        assert h[0] == pytest.approx(3 / 8 * math.log(8), abs=1e-6)

    def test_top3_entropy_of_rows_with_fewer_than_three_possible_tokens(self):
        # top_k <= 2, a small top_p or allowed_token_ids leave -inf logits in the top 3: a
        # token of probability 0 adds nothing (0 log 0 = 0), never NaN.
        rows = torch.full((2, V), -math.inf)
        rows[0, 4] = 1.0
        rows[1, [2, 5]] = 0.0
        h = top3_entropy(rows)
        assert h[0] == pytest.approx(0.0, abs=1e-6)
        assert h[1] == pytest.approx(math.log(2), abs=1e-6)

    def test_a_row_masked_to_two_tokens_can_be_loosened(self):
        rows = logits_for([1, 2, 3], [UNSURE, SURE, SURE])
        rows[0, [0, *range(3, V)]] = -math.inf  # two possible tokens left, split evenly
        loose = loosely_accepted(
            torch.tensor([False, True, True]),
            rows,
            draft([2, 2, 3]),
            torch.ones(3, dtype=torch.bool),
            fly=FLY,
        )
        assert loose.tolist() == [True, False, False]

    def test_normalized_entropy_bounds(self):
        h = normalized_entropy(torch.stack([torch.zeros(V), logits_for([3])[0]]))
        assert h[0] == pytest.approx(1.0, abs=1e-6)
        assert h[1] == pytest.approx(0.0, abs=1e-6)


class TestLooseAcceptance:
    def mask(self, accepted: list[bool], entropy: list[float], window: int) -> list[bool]:
        result = loose_acceptance(
            torch.tensor(accepted), torch.tensor(entropy), window=window, theta=0.3
        )
        return result.tolist()

    def test_uncertain_mismatch_with_clean_window_is_kept(self):
        assert self.mask([True, False, True, True], [0.0, 0.7, 0.0, 0.0], 2) == [
            False,
            True,
            False,
            False,
        ]

    def test_certain_mismatch_is_rejected(self):
        assert not any(self.mask([True, False, True, True], [0.0, 0.1, 0.0, 0.0], 2))

    def test_window_must_fit_inside_the_block(self):
        # Mismatch at i=2, W=2 needs positions 3 and 4; the block ends at 3.
        assert not any(self.mask([True, True, False, True], [0.7] * 4, 2))

    def test_second_mismatch_inside_window_rejects_the_first(self):
        result = self.mask([False, True, False, True, True], [0.7] * 5, 2)
        assert result == [False, False, True, False, False]

    def test_window_zero_keeps_every_uncertain_mismatch(self):
        assert self.mask([False, False], [0.7, 0.7], 0) == [True, True]


def ragged_batch(generator: torch.Generator, num_drafted: list[int]):
    """A flattened batch of blocks with these draft counts: draft ids ``long[T]``, target
    logits ``[T, V]`` mixing certain and split rows, and ``cu_num_drafted`` ``long[B]``."""
    total = sum(num_drafted)
    targets = torch.randint(0, V, (total,), generator=generator)
    kinds = torch.randint(0, 2, (total,), generator=generator).tolist()
    # Draft the target's token most of the time, so windows are often clean.
    wrong = torch.rand(total, generator=generator) < 0.3
    drafts = torch.where(wrong, (targets + 1 + (targets % 3)) % V, targets)
    logits = logits_for(targets.tolist(), kinds) if total else torch.zeros(0, V)
    return drafts, logits, torch.tensor(num_drafted).cumsum(0)


class TestBatchedRule:
    """The flattened-batch form of the rule (what vLLM's sampler calls) equals the one-block
    form request by request."""

    @pytest.mark.parametrize("window", [0, 1, 2, 4])
    def test_batched_loose_acceptance_equals_one_block_at_a_time(self, window):
        generator = torch.Generator().manual_seed(window)
        for _ in range(50):
            num_drafted = torch.randint(0, 8, (5,), generator=generator).tolist()
            drafts, logits, cu = ragged_batch(generator, num_drafted)
            accepted = drafts == logits.argmax(-1)
            fly = FlyConfig(window=window, theta=0.3)
            allowed = torch.ones_like(accepted)
            batched = loosely_accepted(
                accepted, logits, drafts, allowed, fly=fly, cu_num_drafted=cu
            )
            kept = num_leading_kept(accepted | batched, cu)
            start = 0
            for request, n in enumerate(num_drafted):
                block = slice(start, start + n)
                single = loosely_accepted(
                    accepted[block], logits[block], drafts[block], allowed[block], fly=fly
                )
                assert batched[block].tolist() == single.tolist()
                verdict = verify_greedy(
                    drafts[block], torch.cat([logits[block], logits_for([0])]), fly=fly
                )
                assert int(kept[request]) == verdict.num_kept
                assert batched[block][: verdict.num_kept].nonzero().flatten().tolist() == list(
                    verdict.loose_positions
                )
                start += n

    def test_a_window_never_reaches_into_the_next_request(self):
        # Two blocks of 2: the uncertain mismatch at the end of the first would have a clean
        # window of 2 if the second block's positions counted.
        accepted = torch.tensor([True, False, True, True])
        entropy = torch.full((4,), 0.7)
        cu = torch.tensor([2, 4])
        assert not loose_acceptance(accepted, entropy, window=2, theta=0.3, cu_num_drafted=cu).any()
        assert loose_acceptance(accepted, entropy, window=2, theta=0.3)[1]

    def test_leading_kept_counts_per_request(self):
        kept = torch.tensor([True, True, False, True, True, True, False])
        assert num_leading_kept(kept, torch.tensor([3, 3, 6, 7])).tolist() == [2, 0, 3, 0]


class TestVerifyGreedy:
    def test_empty_draft_gives_the_bonus(self):
        verdict = verify_greedy(draft([]), logits_for([5]), fly=FLY)
        assert (verdict.num_kept, verdict.next_token, verdict.is_bonus) == (0, 5, True)

    def test_all_accepted_plus_bonus(self):
        verdict = verify_greedy(draft([1, 2, 3]), logits_for([1, 2, 3, 4]), fly=None)
        assert verdict.num_kept == 3
        assert verdict.is_bonus and verdict.next_token == 4

    def test_first_position_rejected_gives_the_correction(self):
        verdict = verify_greedy(draft([7, 2, 3]), logits_for([1, 2, 3, 4]), fly=None)
        assert (verdict.num_kept, verdict.next_token, verdict.is_bonus) == (0, 1, False)

    def test_exact_spd_ignores_uncertainty(self):
        target = logits_for([1, 2, 3, 4, 5], [UNSURE] * 5)
        verdict = verify_greedy(draft([2, 2, 3, 4]), target, fly=None)
        assert verdict.num_kept == 0 and verdict.next_token == 1

    def test_fly_keeps_an_uncertain_mismatch_followed_by_agreement(self):
        # Target prefers 1 at position 0 but is split between 1 and 2; the draft says 2.
        target = logits_for([1, 2, 3, 4, 5], [UNSURE, SURE, SURE, SURE, SURE])
        verdict = verify_greedy(draft([2, 2, 3, 4]), target, fly=FLY)
        assert verdict.num_kept == 4
        assert verdict.loose_positions == (0,)
        assert verdict.is_bonus and verdict.next_token == 5

    def test_fly_rejects_a_certain_mismatch(self):
        target = logits_for([1, 2, 3, 4, 5])
        verdict = verify_greedy(draft([2, 2, 3, 4]), target, fly=FLY)
        assert verdict.num_kept == 0 and verdict.next_token == 1

    def test_fly_rejects_a_mismatch_near_the_block_end(self):
        target = logits_for([1, 2, 3, 4, 5], [SURE, SURE, UNSURE, SURE, SURE])
        verdict = verify_greedy(draft([1, 2, 4, 4]), target, fly=FLY)
        assert verdict.num_kept == 2 and verdict.next_token == 3
        assert verdict.loose_positions == ()

    def test_fly_rejects_two_mismatches_in_one_window(self):
        target = logits_for([1, 2, 3, 4, 5, 6], [UNSURE, SURE, UNSURE, SURE, SURE, SURE])
        verdict = verify_greedy(draft([2, 2, 4, 4, 5]), target, fly=FLY)
        # Position 0 has a second mismatch (2) inside its window: cut at 0.
        assert verdict.num_kept == 0 and verdict.next_token == 1

    def test_fly_with_infinite_theta_is_exact(self):
        target = logits_for([1, 2, 3, 4, 5], [UNSURE] * 5)
        verdict = verify_greedy(
            draft([2, 2, 3, 4]), target, fly=FlyConfig(window=2, theta=math.inf)
        )
        assert verdict.num_kept == 0

    def test_fly_never_keeps_a_token_with_minus_infinity_logit(self):
        target = logits_for([1, 2, 3, 4, 5], [UNSURE] + [SURE] * 4)
        target[0, 6] = -math.inf
        verdict = verify_greedy(draft([6, 2, 3, 4]), target, fly=FLY)
        assert verdict.num_kept == 0


class TestSamplingProbs:
    def test_top_k_keeps_k_tokens(self):
        probs = sampling_probs(
            torch.arange(V, dtype=torch.float), SamplingConfig(temperature=1.0, top_k=3)
        )
        assert (probs > 0).sum() == 3 and probs[-3:].sum() == pytest.approx(1.0)

    def test_top_p_keeps_the_smallest_sufficient_set(self):
        logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]) + 1e-12)
        probs = sampling_probs(logits, SamplingConfig(temperature=1.0, top_p=0.75))
        assert (probs > 0).tolist()[:4] == [True, True, False, False]

    def test_temperature_sharpens(self):
        logits = torch.tensor([1.0, 0.0])
        cold = sampling_probs(logits, SamplingConfig(temperature=0.5))
        warm = sampling_probs(logits, SamplingConfig(temperature=2.0))
        assert cold[0] > warm[0]


def first_token_histogram(target_probs, draft_probs, *, trials, seed, fly=None, logits=None):
    """Sample a 1-token draft from ``draft_probs`` (or the fixed token 0 when None), verify it,
    and count the first emitted token."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    target_block = torch.stack([target_probs, target_probs])  # [K+1=2, V]
    for _ in range(trials):
        if draft_probs is None:
            token, probs = 0, None
        else:
            token = int(torch.multinomial(draft_probs, 1, generator=generator))
            probs = draft_probs[None]
        verdict = verify_sampling(
            draft([token]),
            probs,
            target_block,
            fly=fly,
            target_logits=logits,
            generator=generator,
        )
        counts[token if verdict.num_kept == 1 else verdict.next_token] += 1
    return counts / trials


class TestSpeculativeSampling:
    target = torch.tensor([0.05, 0.3, 0.25, 0.2, 0.1, 0.05, 0.05, 0.0])
    draft_dist = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])

    def test_sampled_draft_reproduces_the_target_distribution(self):
        hist = first_token_histogram(self.target, self.draft_dist, trials=20000, seed=0)
        assert torch.allclose(hist, self.target, atol=0.015)

    def test_one_hot_draft_reproduces_the_target_distribution(self):
        hist = first_token_histogram(self.target, None, trials=20000, seed=1)
        assert torch.allclose(hist, self.target, atol=0.015)

    def test_never_emits_a_zero_probability_token(self):
        hist = first_token_histogram(self.target, self.draft_dist, trials=5000, seed=2)
        assert hist[-1] == 0

    def test_fly_keeps_rejected_positions_with_window_zero(self):
        # With W=0 and an unsure target every sampling rejection is kept loosely, except
        # tokens the target gives probability 0.
        logits = torch.stack([self.target, self.target]).log()  # unsure: top-3 entropy 0.9
        hist = first_token_histogram(
            self.target,
            self.draft_dist,
            trials=5000,
            seed=3,
            fly=FlyConfig(window=0, theta=0.3),
            logits=logits,
        )
        # Draft token 7 (target probability 0) is rejected and corrected from the residual.
        residual = (self.target - self.draft_dist).clamp_min(0)
        expected = self.draft_dist.clone()
        expected[-1] = 0
        expected += self.draft_dist[-1] * residual / residual.sum()
        assert torch.allclose(hist, expected, atol=0.02)
        assert hist[-1] == 0

    def test_all_accepted_samples_the_bonus_from_the_last_row(self):
        certain = torch.zeros(2, V)
        certain[0, 3] = 1.0
        certain[1, 6] = 1.0
        verdict = verify_sampling(draft([3]), None, certain, fly=None)
        assert verdict.is_bonus and verdict.next_token == 6


class NoHostTensors(TorchDispatchMode):
    """Records every operation that puts a tensor in host memory."""

    def __init__(self):
        super().__init__()
        self.host_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else [out]
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in outputs):
            self.host_ops.append(str(func))
        return out


@pytest.mark.parametrize("max_draft_confidence", [1.0, 0.5])
@pytest.mark.parametrize("with_confidence", [True, False])
def test_the_batched_rule_builds_no_host_tensor_on_a_device(max_draft_confidence, with_confidence):
    """On an accelerator a host tensor in the rule means a copy and a sync at every step; the
    meta device stands in for one."""
    meta = torch.device("meta")
    fly = FlyConfig(window=1, theta=0.3, min_ratio=0.1, max_draft_confidence=max_draft_confidence)
    accepted = torch.zeros(6, dtype=torch.bool, device=meta)
    confidence = torch.zeros(6, device=meta) if with_confidence else None
    with NoHostTensors() as mode:
        loose = loosely_accepted(
            accepted,
            torch.zeros(6, V, device=meta),
            torch.zeros(6, dtype=torch.long, device=meta),
            accepted,
            fly=fly,
            cu_num_drafted=torch.tensor([2, 6], device=meta),
            draft_confidence=confidence,
        )
    assert loose.device == meta
    assert mode.host_ops == []


def test_a_sampled_draft_token_whose_probability_underflows_can_be_loosened():
    """Only a logit of -inf (outside top-k/top-p) bars a token: at logit -200 below the top,
    its float32 probability is 0, yet the target could emit it (as vLLM's own FLy decides)."""
    logits = torch.full((3, V), -1.0e4)
    logits[0, :4] = torch.tensor([0.0, -0.1, -0.2, -200.0])  # unsure, draft token 3 at -200
    logits[1, 0] = logits[2, 0] = 0.0
    verdict = verify_sampling(
        draft([3, 0]),
        None,
        logits.softmax(dim=-1),
        fly=FlyConfig(window=1, theta=0.3),
        target_logits=logits,
        generator=torch.Generator().manual_seed(0),
    )
    assert verdict.num_kept == 2 and verdict.loose_positions == (0,)


def test_an_unread_block_ends_after_its_first_end_token():
    # Target tokens 1 2 7 4 5 6; the draft's 3rd token is an end token (7), drafted past it.
    # The mismatch at 0 is unsure, and the next two positions match: a window of 2 holds within
    # the block's first 3 positions, not past them.
    target = logits_for([1, 2, 7, 4, 5, 6], [UNSURE, SURE, SURE, SURE, SURE, SURE])
    block = draft([0, 2, 7, 4, 5])
    end = torch.tensor([7])
    plain = verify_greedy(block[:3], target[:4], fly=FlyConfig(window=2, theta=0.3))
    unread = verify_greedy(block, target, fly=FlyConfig(window=2, theta=0.3), end_tokens=end)
    assert (unread.num_drafted, unread.num_kept, unread.loose_positions) == (3, 3, (0,))
    assert unread.draft_ids == (0, 2, 7, 4, 5)
    assert replace(unread, draft_ids=()) == replace(plain, draft_ids=())
    # A window that needs the positions past the end token is not loosened there.
    wider = verify_greedy(block, target, fly=FlyConfig(window=3, theta=0.3), end_tokens=end)
    assert (wider.num_drafted, wider.num_kept, wider.next_token) == (3, 0, 1)
    # No end token in the block: all of it counts.
    assert verify_greedy(block, target, fly=None, end_tokens=torch.tensor([9])).num_drafted == 5
