"""``compiles``: per model (name and dtype), the graphs its phases compiled and each compile's
seconds, cold or from inductor's cache; failed where a compile failed or, with a shape of its
own, where the model compiled nothing."""

from __future__ import annotations

from collections.abc import Sequence

from ..runner import PhaseCompiles
from ..table import Row


def compile_rows(phases: Sequence[PhaseCompiles], *, shapes: str) -> list[Row]:
    """One row per model: the graphs its phases compiled, each compile's seconds, cold (built
    by inductor) or warm (from inductor's cache). Failed where a compile failed, or, with
    shapes of their own for every model (not ``tiny``), where a model compiled no graph."""
    by_model: dict[str, list[PhaseCompiles]] = {}
    for phase in phases:
        key = phase.model or f"none expected ({phase.phase}: {phase.subject})"
        if phase.model or phase.compiles:
            by_model.setdefault(key, []).append(phase)
    rows = []
    for model, its in by_model.items():
        compiles = [c for phase in its for c in phase.compiles]
        failures = [c.failure for c in compiles if c.failure]
        seconds = [c.seconds for c in compiles]
        cold = sum(not c.cached for c in compiles)
        values = {
            "graphs": len(compiles),
            "compile_s": [round(t, 2) for t in seconds],
            "cold": cold,
            "failures": failures,
            "phases": [f"{phase.phase}: {phase.subject}" for phase in its if phase.compiles],
        }
        result = f"{len(compiles)} graphs, {sum(seconds):.1f} s compiling"
        detail = (
            f"each: {', '.join(f'{t:.1f} s' for t in seconds) or 'none'}; {cold} cold, "
            f"{len(compiles) - cold} from inductor's cache; in "
            + ("; ".join(values["phases"]) or "no phase")
        )
        status = "ok"
        if failures:
            status, result = "failed", f"{len(failures)} compiles failed ({failures[0]}); {result}"
        elif not compiles and shapes != "tiny":
            status, result = "failed", "no graph compiled: it ran eagerly"
        elif model.startswith("none expected"):
            status, result = "failed", f"compiled where no compile was expected: {result}"
        rows.append(Row("compiles", model, status, result, detail, values))
    return rows
