"""``replay``: the recorded traces (``benchmarks/traces``, recorded on the real pair by
``benchmarks/record_traces.py``) replayed on each target with the 0.5B-shaped draft, both
compiled (:class:`flyspec.bench.replay.ReplayDecoder`): every draft, forward and verification
runs, and each round keeps what the trace says. Tokens per second against the compiled target
alone on the same prompts: speed *at the real pair's recorded acceptance*, never the real
pair's speed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flyspec.bench.replay import ReplayDecoder, Trace, load_traces
from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats

from .. import BENCHMARKS
from ..models import random_prompt
from ..table import Row
from ..timing import after_first_round

TRACES = BENCHMARKS / "traces"


def load_replay_traces() -> dict[tuple[str, str], Trace]:
    """Every recorded trace, by its set (``benchmarks/traces/<set>.json``) and name."""
    traces = {}
    for path in sorted(TRACES.glob("*.json")):
        _, recorded = load_traces(path)
        traces.update({(path.stem, trace.name): trace for trace in recorded})
    return traces


def replay_rows(
    name: str,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    wanted: Sequence[tuple[str, Trace]],
    *,
    requests: int | None,
) -> list[Row]:
    """Each trace of ``wanted`` replayed (:class:`~flyspec.bench.replay.ReplayDecoder`) on
    ``target`` with ``draft`` drafting, both compiled, on random prompts of the traced lengths:
    its decoding speed against the compiled target alone on the same prompts and tokens, a
    round of each trace first, untimed (it compiles)."""
    vocab = target.config.vocab_size
    alone = SpeculativeDecoder(target, forward_path="compiled")
    replaying = ReplayDecoder(target, draft, forward_path="compiled")
    rows = []
    for set_name, trace in wanted:
        chosen = trace.requests[:requests]
        prompts = [random_prompt(vocab, r.prompt_tokens, seed=i) for i, r in enumerate(chosen)]
        references, baseline = [], [0.0, 0]
        for prompt, request in zip(prompts, chosen, strict=True):
            stats = RequestStats()
            config = DecodeConfig(mode="target", max_new_tokens=request.tokens)
            run = after_first_round(alone.stream(prompt, config, stats=stats), stats)
            references.append(list(run.token_ids))
            baseline = [baseline[0] + run.seconds, baseline[1] + run.tokens]
        config = DecodeConfig(mode=trace.mode, drafter=trace.drafter)
        paying = replaying.paying_drafters(trace, config)
        warm = chosen[0]
        list(replaying.replay(prompts[0], warm, references[0], config, paying=paying))
        replaying.counts.agreed = replaying.counts.overruled = 0
        timed = [0.0, 0]
        for prompt, request, reference in zip(prompts, chosen, references, strict=True):
            stats = RequestStats()
            events = replaying.replay(
                prompt, request, reference, config, paying=paying, stats=stats
            )
            run = after_first_round(events, stats)
            timed = [timed[0] + run.seconds, timed[1] + run.tokens]
        alone_speed, replay_speed = baseline[1] / baseline[0], timed[1] / timed[0]
        sources = sorted({r.source for q in chosen for r in q.rounds if r.source})
        counts = replaying.counts
        rows.append(
            Row(
                "replay",
                f"{trace.name} ({set_name}) on the {name} target, compiled",
                "ok",
                f"{replay_speed / alone_speed:.2f}x over the compiled target alone, measured at "
                f"the real pair's recorded acceptance (tau {trace.tau:.2f})",
                f"{replay_speed:.1f} against {alone_speed:.1f} tokens/s decoding (after each "
                f"request's first round), {len(chosen)} requests of the trace, drafted by "
                f"{', '.join(sources)}; the target's own verdict agreed in {counts.agreed} "
                f"rounds, was overruled by the trace in {counts.overruled}",
                {
                    "speedup": replay_speed / alone_speed,
                    "tokens_per_second": replay_speed,
                    "alone_tokens_per_second": alone_speed,
                    "trace_tau": trace.tau,
                    "requests": len(chosen),
                    "agreed": counts.agreed,
                    "overruled": counts.overruled,
                },
            )
        )
    return rows
