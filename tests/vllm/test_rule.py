"""The plugin's batched rule through vLLM's real rejection kernels (CPU build) on synthetic
logits, request by request against flyspec's one-block rule. No engine, no model."""

import math
from dataclasses import replace

import pytest
import torch
from vllm.v1.sample import rejection_sampler as vllm_rs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

from flyspec.config import FlyConfig
from flyspec.decoding.verify import (
    first_unkept,
    loosely_accepted,
    speculative_acceptance,
    verify_greedy,
)
from flyspec.integrations.vllm.metrics import LooseCounter
from flyspec.integrations.vllm.sampler import (
    FlyVerifier,
    empty_batch_safe,
    expand_per_request,
    expansion_is_correct,
)

V = 16
FLY = FlyConfig(window=2, theta=0.3)


def metadata(temperatures: list[float], seeds: list[int | None]) -> SamplingMetadata:
    greedy = [t == 0 for t in temperatures]
    batch = len(temperatures)
    return SamplingMetadata(
        temperature=None if all(greedy) else torch.tensor(temperatures, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None,
        top_k=None,
        generators={i: torch.Generator().manual_seed(seed) for i, seed in enumerate(seeds) if seed},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def random_batch(generator: torch.Generator, num_drafted: list[int]):
    """Draft ids ``int32[T]``, target logits ``[T, V]`` (certain, split and spread rows),
    bonus ids ``[B, 1]`` and ``cu_num_draft_tokens`` ``int32[B]``."""
    total = sum(num_drafted)
    logits = torch.randn(total, V, generator=generator)
    targets = torch.randint(0, V, (total,), generator=generator)
    kind = torch.randint(0, 3, (total,), generator=generator)
    rows = torch.arange(total)
    logits[rows, targets] += torch.where(kind == 0, 30.0, 3.0)  # certain or unsure
    second = (targets + 1) % V
    logits[rows, second] += torch.where(kind == 2, 3.0, 0.0)  # a close second choice
    wrong = torch.rand(total, generator=generator) < 0.3
    drafts = torch.where(wrong, second, logits.argmax(-1))
    bonus = torch.randint(0, V, (len(num_drafted), 1), generator=generator)
    cu = torch.tensor(num_drafted).cumsum(0).to(torch.int32)
    return drafts.to(torch.int32), logits, bonus, cu


def run_plugin(fly, drafts, logits, bonus, cu, num_drafted, sampling, draft_probs=None):
    verifier = FlyVerifier(fly, module=vllm_rs, counter=LooseCounter(None))
    output = verifier.rejection_sample(
        drafts, num_drafted, max(num_drafted), cu, draft_probs, logits.clone(), bonus, sampling
    )
    return output, verifier.counter


def emitted(row: torch.Tensor) -> list[int]:
    return [t for t in row.tolist() if t != vllm_rs.PLACEHOLDER_TOKEN_ID]


def blocks(num_drafted):
    start = 0
    for request, n in enumerate(num_drafted):
        yield request, slice(start, start + n)
        start += n


@pytest.mark.parametrize(
    "fly", [FLY, FlyConfig(window=2, theta=0.3, min_ratio=0.3, max_rank=3)], ids=["paper", "floor"]
)
def test_greedy_batches_equal_verify_greedy_request_by_request(fly):
    generator = torch.Generator().manual_seed(0)
    loose_seen = rejected_seen = 0
    for _ in range(20):
        num_drafted = torch.randint(0, 9, (6,), generator=generator).tolist()
        drafts, logits, bonus, cu = random_batch(generator, num_drafted)
        sampling = metadata([0] * 6, [None] * 6)
        output, counter = run_plugin(fly, drafts, logits, bonus, cu, num_drafted, sampling)
        counter.flush()
        loose_total = 0
        for request, block in blocks(num_drafted):
            bonus_row = torch.full((1, V), -30.0)
            bonus_row[0, bonus[request, 0]] = 30.0
            verdict = verify_greedy(
                drafts[block].long(), torch.cat([logits[block], bonus_row]), fly=fly
            )
            expected = drafts[block][: verdict.num_kept].tolist() + [verdict.next_token]
            assert emitted(output[request]) == expected
            loose_total += verdict.num_loose
            rejected_seen += not verdict.is_bonus
        assert counter.total == loose_total
        loose_seen += loose_total
    assert loose_seen > 0 and rejected_seen > 0  # both outcomes were exercised


def test_loosening_that_cannot_fire_equals_vllms_own_sampler():
    generator = torch.Generator().manual_seed(11)
    num_drafted = [5, 0, 8, 3, 8]
    drafts, logits, bonus, cu = random_batch(generator, num_drafted)
    sampling = metadata([0] * 5, [None] * 5)
    never = FlyConfig(window=2, theta=1e9)
    ours, _ = run_plugin(never, drafts, logits, bonus, cu, num_drafted, sampling)
    theirs = vllm_rs.rejection_sample(
        drafts, num_drafted, 8, cu, None, logits.clone(), bonus, sampling
    )
    assert torch.equal(ours, theirs)


def check_mixed_batch(seed: int) -> int:
    """Greedy and seeded sampled requests in one batch: for a sampled request the plugin's
    decisions are speculative sampling with vLLM's uniform draws, loosened by flyspec's rule;
    the token at the cut is never the rejected draft. Returns the loosely kept sampled
    positions."""
    generator = torch.Generator().manual_seed(100 + seed)
    num_drafted = torch.randint(1, 9, (6,), generator=generator).tolist()
    temperatures = [0.0, 1.0, 0.0, 0.7, 1.0, 0.0]
    seeds = [None, 5 + seed, None, 7 + seed, 9 + seed, None]
    drafts, logits, bonus, cu = random_batch(generator, num_drafted)
    output, _ = run_plugin(
        FLY, drafts, logits, bonus, cu, num_drafted, metadata(temperatures, seeds)
    )
    draws = vllm_rs.generate_uniform_probs(
        sum(num_drafted), num_drafted, metadata(temperatures, seeds).generators, "cpu"
    )
    sampled_loose = 0
    for request, block in blocks(num_drafted):
        row = emitted(output[request])
        block_drafts = drafts[block].long()
        if temperatures[request] == 0:
            accepted = block_drafts == logits[block].argmax(-1)
            allowed = torch.ones_like(accepted)
        else:
            probs = logits[block].softmax(-1)
            at_draft = probs[torch.arange(len(block_drafts)), block_drafts]
            accepted = speculative_acceptance(at_draft, torch.ones_like(at_draft), draws[block])
            allowed = at_draft > 0
        loose = loosely_accepted(accepted, logits[block], block_drafts, allowed, fly=FLY)
        cut = first_unkept(accepted | loose)
        sampled_loose += int(loose[:cut].sum()) if temperatures[request] else 0
        assert row[:cut] == block_drafts[:cut].tolist()
        assert len(row) == cut + 1
        if cut == len(block_drafts):
            assert row[cut] == int(bonus[request, 0])
        elif temperatures[request] == 0:
            assert row[cut] == int(logits[block][cut].argmax())
        else:
            assert row[cut] != int(block_drafts[cut])
    return sampled_loose


def test_mixed_batches_follow_the_rule_with_vllms_own_draws():
    assert sum(check_mixed_batch(seed) for seed in range(8)) > 0  # sampled rows loosened too


def test_a_token_outside_top_k_is_never_kept():
    """An unsure mismatch with a clean window, but its draft token is masked out (logit
    -inf after vLLM's top-k): rejected, even though the gate and window would keep it."""
    logits = torch.full((4, V), -30.0)
    logits[:, 1] = 5.0
    logits[0, 2] = 5.0  # position 0 is unsure between 1 and 2
    logits[0, 3] = -math.inf  # the draft token 3 is outside the target's top-k
    drafts = torch.tensor([3, 1, 1, 1], dtype=torch.int32)
    cu = torch.tensor([4], dtype=torch.int32)
    bonus = torch.tensor([[1]])
    for temperature in (0.0, 1.0):
        output, counter = run_plugin(
            FLY, drafts, logits, bonus, cu, [4], metadata([temperature], [3])
        )
        counter.flush()
        assert counter.total == 0
        assert emitted(output[0])[0] != 3
    kept_when_allowed = logits.clone()
    kept_when_allowed[0, 3] = -30.0
    output, _ = run_plugin(FLY, drafts, kept_when_allowed, bonus, cu, [4], metadata([0], [None]))
    assert emitted(output[0]) == [3, 1, 1, 1, 1]


def test_per_token_expansion():
    values = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert expand_per_request(values, cu, 5, 0, 1).tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert expansion_is_correct(expand_per_request)
    assert not expansion_is_correct(lambda x, cu, n, **_: torch.zeros(n, dtype=x.dtype))


def test_a_step_without_draft_tokens_emits_the_bonus_tokens():
    cu = torch.tensor([0, 0], dtype=torch.int32)
    drafts = torch.zeros(0, dtype=torch.int32)
    bonus = torch.tensor([[4], [9]])
    for temperatures in ([0.0, 0.0], [0.0, 1.0]):
        output, _ = run_plugin(
            FLY, drafts, torch.zeros(0, V), bonus, cu, [0, 0], metadata(temperatures, [1, 2])
        )
        assert [emitted(row) for row in output] == [[4], [9]]


def test_sampling_constraints_leave_an_empty_step_alone():
    sampling = replace(metadata([1.0, 1.0], [1, 2]), top_k=torch.tensor([5, 5], dtype=torch.int32))
    cu = torch.tensor([0, 0], dtype=torch.int32)
    apply = empty_batch_safe(vllm_rs.apply_sampling_constraints)
    assert apply(torch.zeros(0, V), cu, sampling).shape == (0, V)
