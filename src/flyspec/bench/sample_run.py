"""What one method's run of one prompt returns to the bench."""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.decoding.stats import RequestStats


@dataclass
class SampleRun:
    """One prompt run by one method: new tokens (EOS excluded), wall seconds of the call and,
    for flyspec's methods, the per-round statistics."""

    token_ids: list[int]
    seconds: float
    stats: RequestStats | None = None
    peak_rss_bytes: int = 0  # the process and its children while the prompt ran
    state_bytes: int = 0  # KV caches after the prompt (flyspec's methods)
    touched_bytes: int = 0  # the memory the run itself read or wrote (its own)
    prefill_seconds: float | None = None  # reading the prompt but its last token; None: unknown
    server_timings: dict | None = None  # llama-server's own timings of the request
