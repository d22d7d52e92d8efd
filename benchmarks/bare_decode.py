"""The bare llama.cpp decode the llama.cpp benchmark scripts time: a Python loop over
flyspec's llama.cpp runner (:class:`~flyspec.models.llamacpp.LlamaCppForward`), each token the
argmax of the last, after a prompt of random token ids."""

from __future__ import annotations

import time

import numpy as np
import torch


def random_prompt(length: int) -> list[int]:
    """``length`` token ids drawn from a fixed seed: the same prompt in every script."""
    return [int(token) for token in np.random.default_rng(0).integers(100, 20_000, length)]


def bare_decode_seconds(runner, prompt: list[int], tokens: int) -> float:
    """Seconds per new token of ``tokens`` greedy tokens after ``prompt`` (read first,
    untimed), from an empty cache."""
    runner.reset()
    token = int(runner.forward(torch.tensor([prompt]), 1)[0].numpy().argmax())
    started = time.perf_counter()
    for _ in range(tokens):
        token = int(runner.forward(torch.tensor([[token]]), 1)[0].numpy().argmax())
    return (time.perf_counter() - started) / tokens
