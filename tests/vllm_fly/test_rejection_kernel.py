"""vLLM 0.34's built-in FLy (``rejection_sample`` with ``fly_window_size > 0``) against
flyspec's rule (:func:`flyspec.testing.conformance.expected_decisions`)."""

import math

import pytest
import torch
from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

from flyspec.testing.conformance import (
    ConformanceBatch,
    compare,
    coverage,
    expected_decisions,
    random_batch,
    vllm_emitted,
    vllm_rejection_inputs,
)

NUM_BATCHES = 60  # per mode


def run_vllm(batch: ConformanceBatch, seed: int = 0) -> list[list[int]]:
    """The tokens vLLM 0.34's rejection sampler emits for each request of ``batch``."""
    return vllm_emitted(*rejection_sample(**vllm_rejection_inputs(batch, seed=seed)))


def mismatches(batch: ConformanceBatch, seed: int = 0) -> list[str]:
    return [str(m) for m in compare(batch, expected_decisions(batch), run_vllm(batch, seed))]


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_random_batches_agree(mode):
    covered = {}
    for seed in range(NUM_BATCHES):
        batch = random_batch(torch.Generator().manual_seed(seed), mode=mode)
        assert not mismatches(batch, seed), f"seed {seed}"
        for case, count in coverage(batch).items():
            covered[case] = covered.get(case, 0) + count
    for case in ("loose", "window_holds", "window_breaks", "window_does_not_fit", "zero_drafts"):
        assert covered.get(case, 0) > 0, case


def test_realistic_vocabulary_spans_several_vocab_blocks():
    """V above the kernel's 8192-wide vocabulary blocks (and not a multiple of them)."""
    generator = torch.Generator().manual_seed(7)
    batch = random_batch(generator, mode="mixed", num_requests=3, max_drafted=5, vocab_size=20000)
    assert not mismatches(batch)


def one_request(drafts, rows, *, greedy, window=1, theta=0.3) -> ConformanceBatch:
    return ConformanceBatch(
        draft_tokens=(torch.tensor(drafts, dtype=torch.long),),
        target_logits=(torch.tensor(rows, dtype=torch.float32),),
        greedy=(greedy,),
        temperature=(0.0 if greedy else 1.0,),
        kinds=(("hand-made",) * len(drafts),),
        window=window,
        theta=theta,
    )


def test_greedy_tie_takes_the_lower_token_id():
    """A tie for the top logit: both take the lower id as the target's token, so a draft of
    the higher one is an (uncertain, entropy ln 2) mismatch, kept loosely as its window holds."""
    rows = [[0.0, 0.0, -9.0, -9.0], [-9.0, -9.0, 0.0, -9.0], [-9.0, -9.0, -9.0, 0.0]]
    batch = one_request([1, 2], rows, greedy=True)
    decision = expected_decisions(batch)[0]
    assert decision.tokens == (1, 2, 3) and decision.loose_positions == (0,)
    assert run_vllm(batch) == [[1, 2, 3]]


def test_greedy_row_masked_to_two_tokens_defers():
    """A row masked to two finite logits (top-k 2): the top-3 entropy counts nothing for the
    -inf third token, so the mismatch is uncertain (entropy ~ ln 2) and kept loosely."""
    inf = -math.inf
    rows = [[0.0, -0.1, inf, inf], [inf, 0.0, inf, inf], [0.0, inf, inf, inf]]
    batch = one_request([1, 1], rows, greedy=True)
    assert expected_decisions(batch)[0].tokens == (1, 1, 0)
    assert run_vllm(batch) == [[1, 1, 0]]


def test_sampled_draft_with_underflowing_probability_defers():
    """Sampled, window 1, theta 0.3. Position 0: logits [0, -0.1, -0.2, -200] (top-3 entropy
    ~1.1), draft 3 (log-prob ~ -201: finite, probability 0 in float32), rejected. Position 1:
    probability 1 on the draft token 0, accepted. Only a logit of -inf (outside top-k/top-p)
    bars a token from being loosened, so both engines keep both (emit [3, 0, x])."""
    far = -1.0e4
    rows = [[0.0, -0.1, -0.2, -200.0], [0.0, far, far, far], [0.0, far, far, far]]
    batch = one_request([3, 0], rows, greedy=False)
    assert run_vllm(batch)[0][:2] == [3, 0]
    assert expected_decisions(batch)[0].num_kept == 2
