"""``attention``: for each target, the attention the compiled forward runs at 1, 16 and 65 new
tokens (over the whole reserved buffer, a bool mask, grouped-query heads): the kernel torch
dispatches to, its time, each kernel forced in turn (math, memory-efficient, flash, cuDNN;
those that refuse the shape say so), and the same attention over the live positions alone."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from flyspec.errors import error_line

from ..plan import Sizes
from ..table import Row
from ..timing import timed

ATTENTION_NEW_TOKENS = (1, 16, 65)
"""The compiled forward's sizes whose attention kernels the ``attention`` phase times: one
token, a block of 15 and the token before it, a prediction's block of 64 and the one before."""

ATTENTION_BUDGET = 512
"""The tokens a request may generate after the context, in the ``attention`` phase: the
buffer a request reserves holds the context, these and the largest block."""


def attention_row(name: str, model: torch.nn.Module, sizes: Sizes) -> Row:
    """Which attention kernel runs at the compiled forward's shapes, and what each kernel
    costs there: ``scaled_dot_product_attention`` as the forward calls it (the queries of n
    new tokens over the whole reserved buffer, a bool mask, grouped-query heads), the kernel
    torch's dispatch chooses for it, and each kernel forced in turn (those that refuse the
    shape say so); next to them, the same attention over the live positions alone with no
    mask, what a kernel that reads only the live length would cost."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    live = sizes.context
    capacity = live + ATTENTION_BUDGET + max(ATTENTION_NEW_TOKENS)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def median_ms(work: Callable[[], object]) -> float:
        for _ in range(sizes.warmup):
            work()
        return 1000 * statistics.median(timed(device, work) for _ in range(sizes.repeats))

    keys, values = randn(1, kv_heads, capacity, head_dim), randn(1, kv_heads, capacity, head_dim)
    backends = {
        "math": SDPBackend.MATH,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    per_size: dict[int, dict[str, Any]] = {}
    for n in ATTENTION_NEW_TOKENS:
        queries = randn(1, heads, n, head_dim)
        positions = torch.arange(live, live + n, device=device)
        mask = torch.arange(capacity, device=device) <= positions[:, None]  # [n, capacity]
        arguments = {"attn_mask": mask, "scale": head_dim**-0.5, "enable_gqa": heads != kv_heads}
        attention = torch.nn.functional.scaled_dot_product_attention
        attend = functools.partial(attention, queries, keys, values, **arguments)

        timings: dict[str, Any] = {}
        try:
            choice = torch._fused_sdp_choice(
                queries,
                keys,
                values,
                mask,
                0.0,
                False,
                scale=arguments["scale"],
                enable_gqa=arguments["enable_gqa"],
            )
            timings["chosen"] = SDPBackend(choice).name.lower().replace("_attention", "")
        except Exception as error:  # noqa: BLE001 - a private function: say what it said
            timings["chosen"] = f"unknown ({error_line(error, limit=80)})"
        timings["default_ms"] = median_ms(attend)
        for label, backend in backends.items():
            try:
                with sdpa_kernel(backend):
                    timings[f"{label}_ms"] = median_ms(attend)
            except RuntimeError as error:
                timings[f"{label}_ms"] = None
                timings[f"{label}_refused"] = error_line(error, limit=80)
        live_arguments = {**arguments, "attn_mask": None if n == 1 else mask[:, : live + n]}
        attend_live = functools.partial(
            attention, queries, keys[:, :, : live + n], values[:, :, : live + n], **live_arguments
        )
        timings["live_length_ms"] = median_ms(attend_live)
        per_size[n] = timings

    def kernels(n: int) -> str:
        timings = per_size[n]
        forced = ", ".join(
            f"{label} {timings[f'{label}_ms']:.3f}"
            if timings[f"{label}_ms"] is not None
            else f"{label} refused"
            for label in backends
        )
        return f"n={n}: {forced}; live length only {timings['live_length_ms']:.3f} ms"

    result = "; ".join(
        f"n={n}: {t['chosen']} {t['default_ms']:.3f} ms" for n, t in per_size.items()
    )
    return Row(
        "attention",
        f"target {name}: SDPA at the compiled shapes",
        "ok",
        result,
        "forced, ms: "
        + " | ".join(kernels(n) for n in per_size)
        + f"; {heads} heads over {kv_heads}, head dim {head_dim}, {live} live positions of a "
        f"buffer of {capacity}, eager, median of {sizes.repeats}",
        {"live": live, "capacity": capacity, "sizes": per_size},
    )
