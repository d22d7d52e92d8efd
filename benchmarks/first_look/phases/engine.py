"""``engine alone``: flyspec's :class:`~flyspec.decoding.loop.SpeculativeDecoder` in mode
target, greedy, eager: its time per token next to the bound (bytes read per token over the
copy bandwidth); of that time, the forwards' device time and the rest, the loop's. The
compiled phase runs the same row on the compiled forward."""

from __future__ import annotations

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder

from ..models import bytes_per_token, random_prompt
from ..plan import Sizes
from ..table import Row, compiled_suffix, fmt_ms, sync_text
from ..timing import decode_window, timed_lm


def engine_row(
    name: str,
    model: torch.nn.Module,
    sizes: Sizes,
    bandwidth: float | None,
    *,
    role: str,
    forward_path: str = "lean",
) -> Row:
    """A model decoding alone through flyspec's decoder (mode target, greedy): its time per
    token against the bound, split into the forwards' device time and the loop's."""
    device = next(model.parameters()).device
    lm, runner = timed_lm(model, forward_path)
    decoder = SpeculativeDecoder(lm)
    prompt = random_prompt(model.config.vocab_size, sizes.context)
    decode_window(decoder, [runner], prompt, DecodeConfig(mode="target", max_new_tokens=8))
    config = DecodeConfig(mode="target", max_new_tokens=sizes.engine_tokens)
    window = decode_window(decoder, [runner], prompt, config)
    syncs = None
    if device.type == "cuda":
        counted = decode_window(
            decoder,
            [runner],
            prompt,
            DecodeConfig(mode="target", max_new_tokens=sizes.sync_tokens),
            count_syncs=True,
        )
        syncs = None if counted.syncs is None else counted.syncs / counted.tokens
    per_token = window.seconds / window.tokens
    forwards = window.forward_seconds / window.tokens
    weights, kv = bytes_per_token(model, sizes.context)
    values = {
        "ms_per_token": 1000 * per_token,
        "forward_ms_per_token": 1000 * forwards,
        "loop_ms_per_token": 1000 * (per_token - forwards),
        "syncs_per_token": syncs,
        "tokens": window.tokens,
        "token_ids": list(window.token_ids),
    }
    bound = ""
    if bandwidth:
        values["bound_ms"] = 1000 * (weights + kv) / bandwidth
        values["engine_over_bound"] = per_token / ((weights + kv) / bandwidth)
        bound = (
            f"; bound {fmt_ms((weights + kv) / bandwidth)}, "
            f"engine/bound {values['engine_over_bound']:.2f}"
        )
    return Row(
        "engine alone",
        f"{role} {name}, mode target{compiled_suffix(forward_path)}",
        "ok",
        f"{fmt_ms(per_token)} per token{bound}",
        f"forwards {fmt_ms(forwards)} (device time), loop {fmt_ms(per_token - forwards)} per "
        f"token; host syncs per token: {sync_text(device, syncs)}; {window.tokens} tokens "
        "after the first",
        values,
    )
