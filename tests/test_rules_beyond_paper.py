"""The rules beyond the paper (plausibility floor, the draft's doubt, deferral across blocks) on
synthetic logits, checked against a plain statement of the whole rule over every pattern of
short blocks."""

import itertools
import math

import pytest
import torch

from flyspec.config import ConfigError, FlyConfig
from flyspec.decoding.verify import (
    deferred_need,
    draft_unsure,
    loose_token_features,
    loosely_accepted,
    plausible,
    verify_greedy,
    verify_sampling,
)

V = 8
TARGET, DRAFTED = 0, 1  # the target's token at every position, and a mismatching draft token
# What the target thinks at a position where the draft did not match:
CERTAIN = "c"  # sure of its own token: entropy ~ 0
PLAUSIBLE = "p"  # unsure, and the draft token is its close second (ratio 0.9, rank 2)
IMPLAUSIBLE = "i"  # unsure between other tokens; the draft token is far behind (rank 4)
MATCH = "a"  # the draft token is the target's
# The same two mismatches where the draft model was sure of its token (confidence 0.95; every
# other position 0.4):
PLAUSIBLE_SURE_DRAFT = "P"
IMPLAUSIBLE_SURE_DRAFT = "I"
KINDS = MATCH + CERTAIN + PLAUSIBLE + IMPLAUSIBLE + PLAUSIBLE_SURE_DRAFT + IMPLAUSIBLE_SURE_DRAFT
SURE, UNSURE = 0.95, 0.4


def row(kind: str) -> torch.Tensor:
    kind = kind.lower()  # the target's view does not depend on the draft's
    logits = torch.full((V,), -30.0)
    logits[TARGET] = 3.0
    if kind == CERTAIN:
        logits[TARGET] = 30.0
    elif kind == PLAUSIBLE:
        logits[DRAFTED], logits[2] = 3.0 + math.log(0.9), 2.8
    elif kind == IMPLAUSIBLE:
        logits[DRAFTED], logits[2], logits[3] = -5.0, 2.9, 2.8
    return logits


def block(kinds: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens ``long[K]`` and target logits ``[K+1, V]`` (the bonus row is certain)."""
    drafts = torch.tensor([TARGET if k == MATCH else DRAFTED for k in kinds])
    logits = torch.stack([row(k) for k in kinds] + [row(CERTAIN)])
    return drafts, logits


def confidence(kinds: str) -> torch.Tensor:
    """The draft model's confidence ``float[K]`` in each of its tokens."""
    return torch.tensor([SURE if k.isupper() else UNSURE for k in kinds])


def sampled_verdict(drafts, logits, fly, *, temperature=1.0, target_probs=None, seed=0):
    """:func:`verify_sampling` with a one-hot draft at ``temperature`` (or ``target_probs``),
    the rule reading the logits sampled from."""
    if target_probs is None:
        verified_logits = logits / temperature
        target_probs = verified_logits.softmax(-1)
    else:
        verified_logits = target_probs.log()
    generator = torch.Generator().manual_seed(seed)
    return verify_sampling(
        drafts, None, target_probs, fly=fly, target_logits=verified_logits, generator=generator
    )


def oracle(kinds: str, fly: FlyConfig) -> tuple[int, list[int], int]:
    """The rule stated plainly: (cut, loose positions, deferred need; 0 = no deferral)."""
    floor = fly.min_ratio > 0 or fly.max_rank > 0
    doubt_needed = fly.max_draft_confidence < SURE
    loose = []
    for i, kind in enumerate(kinds):
        if kind == MATCH:
            continue
        target_view = kind.lower()
        candidate = target_view == PLAUSIBLE or (target_view == IMPLAUSIBLE and not floor)
        candidate = candidate and not (kind.isupper() and doubt_needed)
        window = kinds[i + 1 : i + 1 + fly.window]
        fits = i + fly.window <= len(kinds) - 1
        if candidate and fits and all(k == MATCH for k in window):
            loose.append(i)
            continue
        tail = kinds[i + 1 :]
        if fly.defer and candidate and not fits and all(k == MATCH for k in tail):
            return i, loose, fly.window - len(tail)
        return i, loose, 0
    return len(kinds), loose, 0


RULES = [
    FlyConfig(window=2, theta=0.3),
    FlyConfig(window=2, theta=0.3, min_ratio=0.5),
    FlyConfig(window=3, theta=0.3, max_rank=2),
    FlyConfig(window=2, theta=0.3, defer=True),
    FlyConfig(window=3, theta=0.3, min_ratio=0.5, defer=True),
    FlyConfig(window=1, theta=0.3, max_rank=3, defer=True),
    FlyConfig(window=2, theta=0.3, max_draft_confidence=0.5),
    FlyConfig(window=2, theta=0.3, max_draft_confidence=0.95),  # at the cap: still unsure
    FlyConfig(window=2, theta=0.3, min_ratio=0.5, max_draft_confidence=0.5, defer=True),
]


# Blocks of up to 5 positions whose draft is never sure, and of up to 4 with every kind.
PATTERNS = [(MATCH + CERTAIN + PLAUSIBLE + IMPLAUSIBLE, n) for n in range(6)] + [
    (KINDS, n) for n in range(1, 5)
]


@pytest.mark.parametrize("fly", RULES, ids=repr)
@pytest.mark.parametrize("alphabet, length", PATTERNS)
def test_every_pattern_matches_the_plain_statement_of_the_rule(fly, alphabet, length):
    for kinds in itertools.product(alphabet, repeat=length):
        kinds = "".join(kinds)
        drafts, logits = block(kinds)
        verdict = verify_greedy(drafts, logits, fly=fly, draft_confidence=confidence(kinds))
        cut, loose, need = oracle(kinds, fly)
        assert list(verdict.loose_positions) == loose, kinds
        if need:
            assert verdict.deferral is not None, kinds
            assert (verdict.deferral.position, verdict.deferral.need) == (cut, need), kinds
            assert verdict.deferral.correction == TARGET
            assert verdict.num_kept == len(kinds) and verdict.is_bonus
            plain = verdict.without_deferral()
            assert (plain.num_kept, plain.next_token, plain.deferral) == (cut, TARGET, None)
        else:
            assert verdict.deferral is None, kinds
            assert verdict.num_kept == cut, kinds
        # Invariants: loose positions are mismatches before the cut; FLy keeps at least as
        # many tokens as exact verification, and the floor and the draft's doubt never keep
        # more than the paper's rule.
        assert all(kinds[i] != MATCH for i in loose)
        exact = verify_greedy(drafts, logits, fly=None)
        assert verdict.num_kept >= exact.num_kept
        paper = verify_greedy(drafts, logits, fly=FlyConfig(window=fly.window, theta=fly.theta))
        if not fly.defer:
            assert verdict.num_kept <= paper.num_kept


def test_leading_exact_run_stops_at_the_first_loose_or_deferred_position():
    fly = FlyConfig(window=1, theta=0.3, defer=True)
    drafts, logits = block("aapapa")
    verdict = verify_greedy(drafts, logits, fly=fly)
    assert verdict.loose_positions == (2, 4) and verdict.num_leading_exact == 2
    drafts, logits = block("aaap")
    verdict = verify_greedy(drafts, logits, fly=FlyConfig(window=2, theta=0.3, defer=True))
    assert verdict.deferral.position == 3 and verdict.num_leading_exact == 3


class TestPlausibilityFloor:
    def test_ratio_to_the_top_token(self):
        logits = torch.tensor([[0.0, math.log(0.5), math.log(0.2), -9.0]])
        for token, expected in [(0, True), (1, True), (2, False)]:
            ok = plausible(logits, torch.tensor([token]), min_ratio=0.4, max_rank=0)
            assert ok.tolist() == [expected]

    def test_rank_counts_ties_in_the_draft_tokens_favour(self):
        logits = torch.tensor([[5.0, 4.0, 4.0, 1.0]])
        ranks = [plausible(logits, torch.tensor([t]), min_ratio=0, max_rank=2) for t in range(4)]
        assert [bool(r) for r in ranks] == [True, True, True, False]

    def test_off_keeps_everything(self):
        logits = torch.randn(5, V)
        assert plausible(logits, torch.arange(5), min_ratio=0, max_rank=0).all()

    def test_the_floor_reads_the_logits_sampled_from(self):
        # The draft token 1 has 0.6 of the top token's probability at T = 1, 0.36 at T = 0.5.
        logits = torch.full((3, V), -30.0)
        logits[0, :3] = torch.tensor([0.0, math.log(0.6), -0.1])
        logits[1, 0] = logits[2, 0] = 30.0
        drafts = torch.tensor([1, 0])
        fly = FlyConfig(window=1, theta=0.3, min_ratio=0.5)
        warm = [sampled_verdict(drafts, logits, fly, seed=seed) for seed in range(20)]
        assert all(v.num_kept == 2 for v in warm)  # accepted by sampling, or kept loosely
        cold = [sampled_verdict(drafts, logits, fly, temperature=0.5, seed=s) for s in range(20)]
        assert any(v.num_kept == 0 for v in cold)  # rejected by sampling, under the floor

    def test_the_batched_form_honours_the_floor(self):
        drafts, logits = block("pa" + "ia")
        accepted = drafts == logits[:-1].argmax(-1)
        fly = FlyConfig(window=1, theta=0.3, min_ratio=0.5)
        cu = torch.tensor([2, 4])
        allowed = torch.ones_like(accepted)
        loose = loosely_accepted(accepted, logits[:-1], drafts, allowed, fly=fly, cu_num_drafted=cu)
        assert loose.tolist() == [True, False, False, False]


class TestDeferral:
    def test_need_is_what_the_block_could_not_hold(self):
        accepted = torch.tensor([True, False, True])
        candidates = torch.tensor([False, True, False])
        assert deferred_need(accepted, candidates, cut=1, window=3) == 2
        assert deferred_need(accepted, candidates, cut=1, window=1) == 0  # it fits
        assert deferred_need(accepted, torch.zeros(3, dtype=torch.bool), cut=1, window=3) == 0
        assert deferred_need(accepted, candidates, cut=3, window=3) == 0  # nothing rejected

    def test_a_mismatch_after_the_cut_prevents_deferral(self):
        drafts, logits = block("apcp")
        verdict = verify_greedy(drafts, logits, fly=FlyConfig(window=4, theta=0.3, defer=True))
        assert verdict.deferral is None and verdict.num_kept == 1

    def test_a_sampled_deferral_samples_both_the_bonus_and_the_correction(self):
        drafts, logits = block("aap")
        fly = FlyConfig(window=2, theta=0.3, defer=True)
        excluded = logits.softmax(-1)
        excluded[2] = 0.0
        excluded[2, TARGET], excluded[2, 2] = 0.5, 0.5  # the draft token has probability 0
        verdict = sampled_verdict(drafts, logits, fly, target_probs=excluded)
        assert verdict.deferral is None  # never kept: the sampling distribution excludes it
        verdicts = [sampled_verdict(drafts, logits, fly, seed=seed) for seed in range(40)]
        deferred = [v for v in verdicts if v.deferral is not None]
        # Sampling accepts the draft token at 2 with its target probability (about 0.32),
        # so some seeds reject it there and defer it; the rest accept it outright.
        assert 0 < len(deferred) < len(verdicts)
        for verdict in deferred:
            assert verdict.deferral.position == 2 and verdict.deferral.need == 2
            assert verdict.deferral.correction != DRAFTED  # sampled from the residual
            assert verdict.next_token == TARGET  # the bonus row is certain
        assert all(v.num_kept == 3 and v.is_bonus for v in verdicts)


class TestDraftDoubt:
    def test_the_cap_is_inclusive_and_one_switches_it_off(self):
        confidence = torch.tensor([0.2, 0.5, 0.9, 1.0])
        assert draft_unsure(confidence, 4, max_draft_confidence=0.5).tolist() == [
            True,
            True,
            False,
            False,
        ]
        assert draft_unsure(confidence, 4, max_draft_confidence=1.0).all()

    def test_a_drafter_without_confidence_counts_as_sure(self):
        assert not draft_unsure(None, 3, max_draft_confidence=0.99).any()
        assert draft_unsure(None, 3, max_draft_confidence=1.0).all()
        drafts, logits = block("pa")
        fly = FlyConfig(window=1, theta=0.3, max_draft_confidence=0.5)
        assert verify_greedy(drafts, logits, fly=fly).num_kept == 0
        paper = FlyConfig(window=1, theta=0.3)
        assert verify_greedy(drafts, logits, fly=paper).num_kept == 2

    def test_sampling_honours_it(self):
        # A one-hot draft of token 1 where the target gives it 0.9 / 1.9: sampling rejects
        # it often; FLy keeps it only when the draft was unsure.
        drafts, logits = block("pa")
        fly = FlyConfig(window=1, theta=0.3, max_draft_confidence=0.5)
        generator = torch.Generator().manual_seed(0)
        probs = logits.softmax(-1)
        for kinds, kept in (("pa", 2), ("Pa", None)):
            verdicts = [
                verify_sampling(
                    drafts,
                    None,
                    probs,
                    fly=fly,
                    target_logits=logits,
                    generator=generator,
                    draft_confidence=confidence(kinds),
                )
                for _ in range(30)
            ]
            counts = {v.num_kept for v in verdicts}
            if kept is not None:
                assert counts == {kept}
            else:
                assert counts == {0, 2}  # loosening off: sampling alone decides

    def test_the_batched_form_honours_it(self):
        drafts, logits = block("pa" + "Pa")
        accepted = drafts == logits[:-1].argmax(-1)
        fly = FlyConfig(window=1, theta=0.3, max_draft_confidence=0.5)
        loose = loosely_accepted(
            accepted,
            logits[:-1],
            drafts,
            torch.ones_like(accepted),
            fly=fly,
            cu_num_drafted=torch.tensor([2, 4]),
            draft_confidence=confidence("paPa"),
        )
        assert loose.tolist() == [True, False, False, False]


def test_loose_token_features_describe_the_targets_view():
    drafts, logits = block("pi")
    features = loose_token_features(logits[:2], drafts, entropy="top3")
    assert features["rank"].tolist() == [2, 4]
    assert features["ratio"][0] == pytest.approx(0.9, rel=1e-5)
    assert features["ratio"][1] < 1e-3
    assert features["target_token"].tolist() == [TARGET, TARGET]
    assert torch.allclose(features["draft_prob"], features["ratio"] * features["top_prob"])


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_ratio", -0.1),
        ("min_ratio", 1.5),
        ("max_rank", -1),
        ("max_rank", 1.5),
        ("max_draft_confidence", -0.1),
        ("max_draft_confidence", 1.01),
        ("max_draft_confidence", True),
        ("defer", 1),
    ],
)
def test_bad_values_of_the_new_rules_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        FlyConfig(**{field: value})
