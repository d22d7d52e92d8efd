"""``same tokens``: every drafter and rule on the device, in float32, with the draft and the
1.5B-shaped target (seeded apart) and a prompt that repeats itself: exact SPD with the draft
model, with the target drafting for itself, with n-gram drafting and with the target's own
answer as the prediction must each give the target alone's greedy tokens (where one does not,
the row fails with the target's top-2 logit margin at the first difference: a near tie can
flip between forwards of different sizes); FLy with the draft model, with MLA, with ``-k auto``
and sampled only have to run. Then the target alone on the compiled forward against the eager
one (the same tokens, or a first difference at a near tie under :data:`NEAR_TIE`, else failed;
with the compiled forward's own check of its first forwards), and exact SPD with the draft
model and with the prediction on the compiled forward, which must give the compiled target
alone's tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.config import DecodeConfig, SamplingConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats
from flyspec.models.cache import CachedLM, common_prefix_length

from ..table import Row

NEAR_TIE = 1e-3
"""A top-2 logit margin below this is a near tie that float32 rounding can flip: a compiled
float32 decode that leaves the eager one there is told, not failed."""


@dataclass(frozen=True)
class SameTokensCase:
    """A decode to compare with the target alone. ``draft``: the draft model drafts
    (``"draft"``), the target drafts for itself (``"self"``), or no model drafts (None);
    ``prediction``: the target's own answer is given as the request's prediction;
    ``lossless``: exact verification, which must give the target's tokens (else the decode
    only has to run: FLy keeps loose tokens, a sampled one draws); ``forward_path``: the
    models' forward (the reference is the target alone's on the same forward)."""

    subject: str
    config: DecodeConfig
    draft: str | None = "draft"
    prediction: bool = False
    lossless: bool = True
    forward_path: str = "lean"


def same_tokens_cases(k: int) -> list[SameTokensCase]:
    """Each drafter and rule of the engine once: exact SPD (lossless) with the draft model,
    the target drafting for itself (every block kept), n-gram drafting and a prediction;
    FLy with the draft model, MLA, -k auto and sampling."""
    exact, fly = DecodeConfig(mode="spd", k=k), DecodeConfig(mode="fly", k=k)
    sampled = SamplingConfig(temperature=0.8, seed=0)
    return [
        SameTokensCase(f"spd K={k}, the draft model drafting", exact),
        SameTokensCase(f"spd K={k}, the target drafting for itself", exact, draft="self"),
        SameTokensCase(
            f"spd K={k}, n-gram drafting", exact.with_updates(drafter="ngram"), draft=None
        ),
        SameTokensCase(
            f"spd K={k}, the target's own answer as the prediction", exact, prediction=True
        ),
        SameTokensCase(f"fly K={k}, the draft model drafting", fly, lossless=False),
        SameTokensCase(f"fly K={k}, MLA drafting", fly.with_updates(drafter="mla"), lossless=False),
        SameTokensCase(f"fly -k auto, K up to {k}", fly.with_updates(auto_k=True), lossless=False),
        SameTokensCase(
            f"fly K={k}, sampled at T=0.8", fly.with_updates(sampling=sampled), lossless=False
        ),
    ]


def compiled_same_tokens_cases(k: int) -> list[SameTokensCase]:
    """The lossless cases on the compiled forward, against the compiled target alone: exact
    SPD with the draft model and with the target's answer as the prediction."""
    exact = DecodeConfig(mode="spd", k=k)
    return [
        SameTokensCase(
            f"spd K={k}, the draft model drafting, compiled", exact, forward_path="compiled"
        ),
        SameTokensCase(
            f"spd K={k}, the target's own answer as the prediction, compiled",
            exact,
            prediction=True,
            forward_path="compiled",
        ),
    ]


def same_tokens_row(
    case: SameTokensCase,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt: list[int],
    reference: list[int],
) -> Row:
    """``case`` decoded on the device, its tokens against ``reference``, the target's greedy
    answer to ``prompt``; where an exact decode differs, the target's margin between its two
    most likely tokens there (a near tie can flip between forwards of different sizes)."""
    drafting = {"draft": draft, "self": target, None: None}[case.draft]
    decoder = SpeculativeDecoder(target, drafting, forward_path=case.forward_path)
    stats = RequestStats()
    config = case.config.with_updates(max_new_tokens=len(reference))
    events = decoder.stream(
        prompt, config, stats=stats, prediction=reference if case.prediction else None
    )
    tokens = [event.token for event in events]
    same = common_prefix_length(tokens, reference)
    differs = None if tokens == reference else same
    values = {
        "tokens": len(tokens),
        "same_as_target": same,
        "rounds": stats.num_rounds,
        "tau": stats.tau,
        "drafted": stats.drafted,
        "kept_exactly": stats.accepted,
        "kept_loosely": stats.loosely_accepted,
    }
    detail = (
        f"{stats.num_rounds} rounds, tau {stats.tau:.2f}; of {stats.drafted} drafted, "
        f"{stats.accepted} kept exactly, {stats.loosely_accepted} loosely"
    )
    if not case.lossless:
        result = f"ran: {len(tokens)} tokens, the first {same} as the greedy target's"
        return Row("same tokens", case.subject, "ok", result, detail, values)
    if differs is None:
        result = f"{same}/{len(reference)} tokens as the target alone"
        return Row("same tokens", case.subject, "ok", result, detail, values)
    margin = values["target_top2_margin"] = top2_margin(target, prompt + reference[:differs])
    return Row(
        "same tokens",
        case.subject,
        "failed",
        f"differs from the target alone at token {differs + 1} of {len(reference)}",
        f"{detail}; the target's top-2 logit margin there {margin:.2g}",
        values,
    )


def top2_margin(target: torch.nn.Module, tokens: list[int]) -> float:
    """The eager target's margin between its two most likely next tokens after ``tokens``."""
    logits = CachedLM(target, forward_path="lean").logits(tokens, 1)[0]
    top = logits.float().topk(2).values.tolist()
    return top[0] - top[1]


def compiled_against_eager_row(
    target: torch.nn.Module, prompt: list[int], reference: list[int], compiled: list[int]
) -> Row:
    """The target alone on the compiled forward against the eager ``reference`` (float32):
    the same tokens, or a first difference at a near tie (:data:`NEAR_TIE`) that rounding
    can flip; a difference where the target was sure fails. ``compiled`` receives the
    compiled decode's tokens (the compiled cases' reference)."""
    decoder = SpeculativeDecoder(target, forward_path="compiled")
    config = DecodeConfig(mode="target", max_new_tokens=len(reference))
    compiled.extend(event.token for event in decoder.stream(prompt, config))
    checks = getattr(decoder.target.runner, "compile_checks", {})
    values = {"tokens": len(compiled), "token_ids": list(compiled), "compile_checks": checks}
    detail = "first forwards against eager (largest logit difference over the largest logit): "
    detail += ", ".join(f"{kind} {value:.2g}" for kind, value in checks.items()) or "none"
    same = values["same_as_eager"] = common_prefix_length(compiled, reference)
    if compiled == reference:
        return Row(
            "same tokens",
            "the target alone, compiled, against eager",
            "ok",
            f"{same}/{len(reference)} tokens as eager",
            detail,
            values,
        )
    margin = values["eager_top2_margin"] = top2_margin(target, prompt + reference[:same])
    near_tie = margin < NEAR_TIE
    return Row(
        "same tokens",
        "the target alone, compiled, against eager",
        "ok" if near_tie else "failed",
        f"differs from eager at token {same + 1} of {len(reference)}"
        + (", a near tie" if near_tie else ""),
        f"{detail}; the eager target's top-2 logit margin there {margin:.2g}",
        values,
    )
