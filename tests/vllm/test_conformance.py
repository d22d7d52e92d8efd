"""The plugin's FLy through vLLM 0.32's CPU kernels against flyspec's rule on the conformance
batches (flyspec.testing.conformance): greedy, sampled and mixed ragged batches with
placeholders, rows masked to fewer than 3 finite logits and zero-draft requests."""

import pytest
import torch
from vllm.v1.sample import rejection_sampler as vllm_rs

from flyspec.integrations.vllm.metrics import LooseCounter
from flyspec.integrations.vllm.sampler import FlyVerifier
from flyspec.testing.conformance import (
    compare,
    coverage,
    emitted_rows,
    expected_decisions,
    random_batch,
    vllm_v1_rejection_inputs,
)
from tests.vllm.test_rule import metadata


def run_plugin(batch, seed: int) -> list[list[int]]:
    verifier = FlyVerifier(batch.fly, module=vllm_rs, counter=LooseCounter(None))
    seeds = [seed * 100 + r + 1 for r in range(batch.num_requests)]
    sampling = metadata(list(batch.temperature), seeds)
    output = verifier.rejection_sample(
        **vllm_v1_rejection_inputs(batch), sampling_metadata=sampling
    )
    return emitted_rows(output, vllm_rs.PLACEHOLDER_TOKEN_ID)


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_the_plugin_decides_as_flyspec_request_by_request(mode):
    generator = torch.Generator().manual_seed({"greedy": 1, "sampled": 2, "mixed": 3}[mode])
    seen = coverage(random_batch(generator, mode=mode))
    for seed in range(40):
        batch = random_batch(generator, mode=mode)
        decisions = expected_decisions(batch)
        mismatches = compare(batch, decisions, run_plugin(batch, seed))
        assert not mismatches, "\n".join(map(str, mismatches))
        seen += coverage(batch, decisions)
    assert seen["loose"] > 0 and seen["window_breaks"] > 0 and seen["zero_drafts"] > 0
    assert seen["placeholder"] > 0 and seen["narrow_rows"] > 0
