"""How the plugin meets vLLM's rejection sampler module: start-up checks, the host-tensor
probes of CPU-build bugs, and the calls into vLLM's private kernels. Proxies of vLLM 0.32's
module stand in for other platforms and releases."""

from types import ModuleType

import pytest
import torch
from vllm.v1.sample import rejection_sampler as vllm_rs

from flyspec.config import FlyConfig
from flyspec.integrations.vllm.metrics import LooseCounter
from flyspec.integrations.vllm.sampler import (
    FlyVerifier,
    VllmPluginError,
    build_verifier,
    check_seam,
)
from tests.vllm.test_rule import metadata, random_batch


def proxy(**overrides) -> ModuleType:
    """A copy of vLLM's rejection sampler module with some names replaced."""
    module = ModuleType(vllm_rs.__name__)
    module.__dict__.update(vllm_rs.__dict__)
    module.__dict__.update(overrides)
    return module


def refuses_host_tensors(*args, **kwargs):
    raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")


@pytest.fixture
def fly_on(monkeypatch):
    monkeypatch.setenv("FLYSPEC_VLLM", "{}")


def test_an_accelerator_engine_starts_without_the_host_tensor_probes(fly_on):
    """vLLM's Triton helpers on a GPU refuse host tensors; the probes of the CPU build's bugs
    must not run there."""
    module = proxy(
        expand_batch_to_tokens=refuses_host_tensors, apply_top_k_top_p=refuses_host_tensors
    )
    verifier = build_verifier(None, torch.device("cuda"), module=module)
    assert isinstance(verifier, FlyVerifier)
    assert module.expand_batch_to_tokens is refuses_host_tensors


def test_a_cpu_engine_replaces_a_wrong_expansion(fly_on):
    def wrong(values, cu_num_tokens, num_tokens, **_):
        return torch.zeros(num_tokens, dtype=values.dtype)

    module = proxy(expand_batch_to_tokens=wrong)
    build_verifier(None, torch.device("cpu"), module=module)
    assert module.expand_batch_to_tokens is not wrong


def test_a_kernel_with_other_parameters_stops_the_start_up():
    def greedy_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax):
        raise AssertionError("never called")

    with pytest.raises(VllmPluginError, match="_rejection_greedy_sample"):
        check_seam(proxy(_rejection_greedy_sample=greedy_kernel))
    check_seam(vllm_rs)


class KernelRecorder:
    """Wraps one of vLLM's kernels: takes its arguments by name only and records them."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, *args, **kwargs):
        assert not args, "a private kernel called with positional arguments"
        self.calls.append(kwargs)
        return self.kernel(**kwargs)


def test_kernels_are_called_by_name_with_vllms_greedy_temperature():
    greedy = KernelRecorder(vllm_rs._rejection_greedy_sample)
    sampled = KernelRecorder(vllm_rs._rejection_random_sample)
    # A release that marks greedy requests by another temperature: the plugin must read it.
    module = proxy(
        _rejection_greedy_sample=greedy, _rejection_random_sample=sampled, GREEDY_TEMPERATURE=0.7
    )
    verifier = FlyVerifier(FlyConfig(window=2), module=module, counter=LooseCounter(None))
    num_drafted = [3, 4, 2]
    drafts, logits, bonus, cu = random_batch(torch.Generator().manual_seed(4), num_drafted)
    sampling = metadata([0.7, 1.0, 0.0], [None, 3, None])
    verifier.rejection_sample(drafts, num_drafted, 4, cu, None, logits, bonus, sampling)
    assert len(greedy.calls) == len(sampled.calls) == 1
    assert greedy.calls[0]["is_greedy"].tolist() == [True, False, False]
