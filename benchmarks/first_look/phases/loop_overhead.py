"""``loop overhead``: the target drafting for itself (a draft model that agrees with the
target, FLy at block size K): per round, the wall time minus the device time of its forwards,
which is the time the device waits for the loop (its Python, verification, host
synchronisations), and the host synchronisations per round (on CUDA: the calls
``torch.cuda.set_sync_debug_mode`` reports, counted in a separate untimed run). The compiled
phase runs the same row on the compiled forward."""

from __future__ import annotations

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder

from ..models import random_prompt
from ..plan import Sizes
from ..table import Row, compiled_suffix, fmt_ms, sync_text
from ..timing import decode_window, timed_lm


def overhead_row(
    name: str, model: torch.nn.Module, sizes: Sizes, k: int, *, forward_path: str = "lean"
) -> Row:
    """The target drafting for itself with FLy at block size ``k``: the loop's own time per
    round beyond its forwards, and its host synchronisations."""
    device = next(model.parameters()).device
    target_lm, target_runner = timed_lm(model, forward_path)
    draft_lm, draft_runner = timed_lm(model, forward_path)
    decoder = SpeculativeDecoder(target_lm, draft_lm)
    runners = [target_runner, draft_runner]
    prompt = random_prompt(model.config.vocab_size, sizes.context)
    decode_window(decoder, runners, prompt, DecodeConfig(mode="fly", k=k, max_new_tokens=2 * k + 4))
    config = DecodeConfig(mode="fly", k=k, max_new_tokens=sizes.overhead_tokens)
    window = decode_window(decoder, runners, prompt, config)
    syncs = None
    if device.type == "cuda":
        counted = decode_window(
            decoder,
            runners,
            prompt,
            config.with_updates(max_new_tokens=max(sizes.sync_tokens, 3 * (k + 1))),
            count_syncs=True,
        )
        syncs = None if counted.syncs is None else counted.syncs / counted.rounds
    round_s = window.seconds / window.rounds
    forwards = window.forward_seconds / window.rounds
    values = {
        "k": k,
        "overhead_ms_per_round": 1000 * (round_s - forwards),
        "round_ms": 1000 * round_s,
        "forward_ms_per_round": 1000 * forwards,
        "tokens_per_round": window.tokens / window.rounds,
        "drafted_per_round": window.drafted / window.rounds,
        "kept_fraction": window.kept / window.drafted if window.drafted else None,
        "syncs_per_round": syncs,
        "rounds": window.rounds,
        "token_ids": list(window.token_ids),
    }
    return Row(
        "loop overhead",
        f"target {name} drafting for itself, FLy K={k}{compiled_suffix(forward_path)}",
        "ok",
        f"{fmt_ms(round_s - forwards)} per round beyond the forwards",
        f"round {fmt_ms(round_s)}, forwards {fmt_ms(forwards)} (device time); "
        f"{window.tokens / window.rounds:.2f} tokens per round, "
        f"{window.kept}/{window.drafted} drafted kept; host syncs per round: "
        f"{sync_text(device, syncs)}; "
        f"{window.rounds} rounds after the first",
        values,
    )
