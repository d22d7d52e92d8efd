"""The log-probabilities of emitted tokens (OpenAI's ``logprobs``): pure tensor functions, no
models, no caches.

A token's log-probability is read from the distribution verification read at its position:
the target's logits after the request's penalties and, above temperature 0, after
temperature, top-k and top-p (the distribution it was drawn from). A loosely kept token gets
its own, however unlikely the target found it: FLy's cost, token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""The most alternatives a token's record may list (OpenAI's limit)."""


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability, and the ``top`` most likely tokens at its position
    as ``(token id, log-probability)`` pairs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, top: int) -> list[TokenLogprob]:
    """``[R, V], long[R] -> R records``: the log-softmax of each row at its token, with the
    row's ``top`` likeliest tokens; one read of the device for them all."""
    log_probs = logits.float().log_softmax(dim=-1)  # [R, V]
    chosen = log_probs.gather(1, tokens.to(log_probs.device).long()[:, None])  # [R, 1]
    parts = [chosen.double()]
    if top:
        values, ids = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)  # [R, top] each
        parts += [ids.double(), values.double()]
    rows = torch.cat(parts, dim=1).tolist()
    width = (len(rows[0]) - 1) // 2 if rows else 0
    return [
        TokenLogprob(
            logprob=row[0],
            top=tuple(
                (int(token), value)
                for token, value in zip(row[1 : 1 + width], row[1 + width :], strict=True)
            ),
        )
        for row in rows
    ]
