"""Merged int8 projections: fewer int8 calls per token, the same bits."""

import copy
import warnings

import pytest
import torch

from flyspec.models.kernels import (
    GatedMLP,
    merge_int8_projections,
    merged_int8_linear,
    quantize_int8,
)
from flyspec.models.lean import LeanForward
from tests.tiny import make_tiny_model

VOCAB = 96


def quantize_separately(module: torch.nn.Module) -> torch.nn.Module:
    """torch's dynamic int8 quantisation of each Linear on its own: the reference."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("bias", [True, False])
def test_a_merged_int8_linear_gives_the_bits_of_the_separate_ones(bias):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # different weight ranges, so that each part needs its own scale
        linears = [torch.nn.Linear(48, out, bias=bias) for out in (64, 16, 16)]
        linears[1].weight.data *= 5
    merged = merged_int8_linear(linears)
    separate = quantize_separately(torch.nn.ModuleList(linears))
    x = torch.randn(1, 7, 48, generator=torch.Generator().manual_seed(1))
    for block in (x, x[:, :1]):  # the activation scale is per call: compare call for call
        expected = torch.cat([linear(block) for linear in separate], dim=-1)
        assert torch.equal(merged(block), expected)


def test_int8_with_merged_projections_keeps_both_forward_paths_bit_identical():
    model = make_tiny_model(vocab_size=VOCAB, seed=5)
    reference = quantize_separately(copy.deepcopy(model))
    quantize_int8(model)
    assert all(isinstance(layer.mlp, GatedMLP) for layer in model.model.layers)
    assert all(hasattr(layer.self_attn, "merged_qkv_proj") for layer in model.model.layers)

    tokens = torch.tensor([[5, 9, 14, 3, 40, 41, 7, 60, 2]])
    with torch.inference_mode():
        # transformers' forward: the merged MLP is used, the attention keeps q/k/v
        assert torch.equal(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)
        # the lean forward: merged q/k/v as well; prefill, then one- and two-token blocks
        merged_lean, reference_lean = LeanForward(model), LeanForward(reference)
        for block, num_logits in ((tokens[:, :6], 1), (tokens[:, 6:7], 1), (tokens[:, 7:], 2)):
            assert torch.equal(
                merged_lean.forward(block, num_logits), reference_lean.forward(block, num_logits)
            )


def test_only_float_linear_layers_are_merged():
    model = quantize_separately(make_tiny_model(vocab_size=VOCAB, seed=5))
    assert merge_int8_projections(model) == 0
    assert not any(isinstance(layer.mlp, GatedMLP) for layer in model.model.layers)
    assert not hasattr(model.model.layers[0].self_attn, "merged_qkv_proj")


@pytest.mark.parametrize("layout", ["pack", "fp16"])
def test_file_pages_are_released_while_their_weights_are_still_held(monkeypatch, layout):
    """madvise on a range whose mapping is already gone could wipe whatever memory reused
    it: each release comes while the weights it names are still alive."""
    import weakref

    from flyspec.models import kernels

    if layout == "pack" and not kernels.onednn_linear_available():
        pytest.skip("oneDNN's linear is not in this torch build")
    model = make_tiny_model(vocab_size=96, seed=3, num_layers=2)
    alive = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            alive[module.weight.data_ptr()] = weakref.ref(module.weight)
    released = []

    def release(ranges):
        released.append(all(alive[address]() is not None for address, _ in ranges))

    # Every weight counts as mapped from a file here, so each release names its weights.
    monkeypatch.setattr(
        kernels, "file_backed", lambda tensors, _: [(t.data_ptr(), t.nbytes) for t in tensors]
    )
    monkeypatch.setattr(kernels, "release_file_pages", release)
    if layout == "pack":
        kernels.pack_linear_layers(model)
    else:
        kernels.quantize_fp16(model)
    assert released and all(released)


def test_a_release_the_kernel_refuses_is_reported():
    from flyspec.models.pages import release_file_pages

    with pytest.warns(RuntimeWarning, match="could not release"):
        release_file_pages([(4096, 8192)])  # the first pages of the address space: unmapped
