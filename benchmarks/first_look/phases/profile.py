"""``profile``: the first target's eager one-token forward under torch's profiler, timed alone
and inside the decoder: host time, kernel launches and device time per token, and the
operators with the most host time (where a forward inside the decoder loses its time)."""

from __future__ import annotations

import time

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.models.cache import make_forward
from flyspec.models.timing import wait_for_device

from ..models import random_prompt
from ..plan import Sizes
from ..table import Row, fmt_ms


def profile_row(name: str, model: torch.nn.Module, sizes: Sizes, *, tokens: int = 6) -> Row:
    """Where the eager forward's time goes, alone and inside the decoder: torch's profiler over
    ``tokens`` one-token forwards timed alone (as ``V(1)``) and over as many tokens of the
    decoder in mode target; per forward, the host's time, the kernels launched and the device's
    time, and the operators with the most host time in the decoder."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prompt = random_prompt(model.config.vocab_size, sizes.context)
    runner = make_forward(model, "lean")
    token = torch.tensor([[prompt[-1]]], device=device)
    decoder = SpeculativeDecoder(model, forward_path="lean")
    config = DecodeConfig(mode="target", max_new_tokens=tokens)
    with torch.inference_mode():
        runner.forward(torch.tensor([prompt], device=device), 1)
        for _ in range(2):  # warm-up
            runner.crop(len(prompt))
            runner.forward(token, 1)
    list(decoder.stream(prompt, config))

    def lone() -> None:
        with torch.inference_mode():
            for _ in range(tokens):
                runner.crop(len(prompt))
                runner.forward(token, 1)
        wait_for_device(device)

    def in_decoder() -> None:
        list(decoder.stream(prompt, config))
        wait_for_device(device)

    figures = {}
    for label, work in (("alone", lone), ("decoder", in_decoder)):
        with profile(activities=activities) as profiled:
            started = time.perf_counter()
            work()
            wall = time.perf_counter() - started
        events = profiled.key_averages()
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
        figures[label] = {
            "wall_ms_per_token": 1000 * wall / tokens,
            "launches_per_token": launches / tokens,
            "device_ms_per_token": device_us / 1000 / tokens,
            "top_host_ops": [
                (e.key, round(e.self_cpu_time_total / 1000 / tokens, 3))
                for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
            ],
        }
    alone, inside = figures["alone"], figures["decoder"]
    top = ", ".join(f"{op} {ms:.2g} ms" for op, ms in inside["top_host_ops"][:5])
    return Row(
        "profile",
        f"target {name}, eager: a forward alone and in the decoder",
        "ok",
        f"{fmt_ms(alone['wall_ms_per_token'] / 1000)} a token alone, "
        f"{fmt_ms(inside['wall_ms_per_token'] / 1000)} in the decoder (profiled)",
        f"kernel launches per token {alone['launches_per_token']:.0f} alone, "
        f"{inside['launches_per_token']:.0f} in the decoder; device time per token "
        f"{alone['device_ms_per_token']:.3g} ms and {inside['device_ms_per_token']:.3g} ms; "
        f"most host time in the decoder, per token: {top}",
        figures,
    )
