"""The phase runner: each phase run in turn under the run's time limit, a failure a row with
its reason, the rows saved after every phase, and the graphs each phase compiled."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyspec.errors import error_line

from .table import PhaseSkipped, Row, log, markdown


@dataclass(frozen=True)
class Compile:
    """One graph compiled by dynamo in a phase (one frame, fullgraph): its seconds, whether
    inductor found it in its cache (a warm compile), and why it failed (None: it did not)."""

    seconds: float
    cached: bool
    failure: str | None


@dataclass(frozen=True)
class PhaseCompiles:
    """The graphs a phase compiled, for the model ``model`` (the one the phase compiles
    first; None: a phase meant to compile nothing)."""

    model: str | None
    phase: str
    subject: str
    compiles: tuple[Compile, ...]


def compiles_since_cleared() -> tuple[Compile, ...]:
    """The graphs dynamo compiled since its metrics were last cleared."""
    from torch._dynamo.utils import get_compilation_metrics

    return tuple(
        Compile(
            seconds=m.entire_frame_compile_time_s or 0.0,
            cached=bool(m.inductor_fx_local_cache_hit_count)
            and not m.inductor_fx_local_cache_miss_count,
            failure=m.fail_type,
        )
        for m in get_compilation_metrics()
        if m.co_name  # a frame's compile (not a runtime record)
    )


class PhaseRunner:
    """Runs the phases one by one and keeps their rows, with the start time and the time limit
    of the run, and the graphs each phase compiled. After each phase, ``after_phase`` gets the
    rows so far (the run saves them: a run cut short keeps what it measured)."""

    def __init__(
        self, time_limit: float, after_phase: Callable[[list[Row]], None] | None = None
    ) -> None:
        self.time_limit = time_limit
        self.after_phase = after_phase
        self.started = time.perf_counter()
        self.rows: list[Row] = []
        self.compiles: list[PhaseCompiles] = []

    def phase(
        self,
        phase: str,
        subject: str,
        work: Callable[[], Row | list[Row]],
        *,
        needs: float = 0,
        compiles: str | None = None,
    ) -> list[Row]:
        """Run one phase and add its rows: a failure is a row with its reason, and a phase
        that would start past the time limit, or end past it by its expected ``needs``
        seconds, is skipped. The graphs it compiles are counted for the model ``compiles``,
        and its time is said and kept in its first row (``phase_s``)."""
        from torch._dynamo.utils import clear_compilation_metrics

        elapsed = time.perf_counter() - self.started
        if elapsed + needs > self.time_limit:
            reason = f"time limit of {self.time_limit:.0f} s"
            if needs:
                reason += f" (needs about {needs:.0f} s, {elapsed:.0f} s gone)"
            rows = [Row(phase, subject, "skipped", reason)]
        else:
            log(f"{phase}: {subject} ({elapsed:.0f} s)")
            clear_compilation_metrics()
            try:
                produced = work()
                rows = produced if isinstance(produced, list) else [produced]
            except PhaseSkipped as skipped:
                rows = [Row(phase, subject, "skipped", str(skipped))]
            except Exception as error:  # every failure is reported and the run goes on
                reason = error_line(error, limit=200)
                log(f"{phase}: {subject} FAILED: {reason}")
                rows = [Row(phase, subject, "failed", reason)]
            seconds = time.perf_counter() - self.started - elapsed
            compiled = compiles_since_cleared()
            self.compiles.append(PhaseCompiles(compiles, phase, subject, compiled))
            rows[0].values["phase_s"] = round(seconds, 2)
            said = f"{phase}: {subject} took {seconds:.1f} s"
            if compiled:
                each = ", ".join(f"{c.seconds:.1f}" for c in compiled)
                said += f", {len(compiled)} graphs compiled ({each} s)"
            log(said)
        self.rows.extend(rows)
        for row in rows:
            log(markdown([row]).splitlines()[-1])
        if self.after_phase is not None:
            self.after_phase(self.rows)
        return rows

    def value(self, rows: list[Row], key: str) -> Any:
        """``values[key]`` of the first ok row of ``rows`` that has it (None when none does)."""
        return next((r.values[key] for r in rows if r.status == "ok" and key in r.values), None)
