"""Histograms of sampled decoding, and their distance from an expected distribution."""

from __future__ import annotations

from dataclasses import replace

import torch

from flyspec.config import DecodeConfig, SamplingConfig


def token_histogram(
    decoder,
    prompt: list[int],
    sampling: SamplingConfig,
    *,
    trials: int,
    position: int = 0,
    **options,
) -> torch.Tensor:
    """The share of ``trials`` requests (exact speculative sampling, K=3, a draft sampled at
    temperature 1; seeds 0..trials-1) whose token at ``position`` is each token:
    ``float[V]``. ``options`` go to the decoder's ``stream`` (a grammar)."""
    histogram = torch.zeros(decoder.vocab_size)
    for seed in range(trials):
        config = DecodeConfig(
            mode="spd",
            k=3,
            max_new_tokens=position + 1,
            draft_temperature=1.0,
            sampling=replace(sampling, seed=seed),
        )
        tokens = [event.token for event in decoder.stream(prompt, config, **options)]
        histogram[tokens[position]] += 1
    return histogram / trials


def binned_distance(observed: torch.Tensor, expected: torch.Tensor, *, bins: int) -> float:
    """Total variation between two distributions ``float[V]`` over ``bins`` bins: the
    ``bins - 1`` tokens ``expected`` finds likeliest, and the rest (a few bins keep the
    sampling noise of a few hundred draws small)."""
    top = expected.topk(bins - 1).indices

    def binned(probs: torch.Tensor) -> torch.Tensor:
        return torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)])

    return float(0.5 * (binned(observed) - binned(expected)).abs().sum())
