"""``goal``: last, one row per goal of the GPU engine (:data:`GOALS`, and the same tokens of
exact decoding): met, missed or not run, with its figure (on the CPU, a rehearsal of the
table, not a GPU figure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..table import Row


@dataclass(frozen=True)
class Goal:
    """A goal of the GPU engine: the row (``phase``, a part of its ``subject``) and value it
    is read from, the bound it must meet, and whether smaller is better."""

    name: str
    phase: str
    subject: str
    key: str
    bound: float
    smaller: bool = True
    unit: str = ""


GOALS = (
    Goal(
        "target alone, compiled, engine/bound, 32B shape",
        "compiled",
        "target 32b, mode target",
        "engine_over_bound",
        1.3,
    ),
    Goal(
        "target alone, compiled, engine/bound, 7B shape",
        "compiled",
        "target 7b, mode target",
        "engine_over_bound",
        1.3,
    ),
    Goal(
        "target alone, compiled, engine/bound, 1.5B",
        "compiled",
        "target 1.5b, mode target",
        "engine_over_bound",
        2.0,
    ),
    Goal(
        "loop time per round beyond its forwards",
        "compiled",
        "drafting for itself",
        "overhead_ms_per_round",
        0.3,
        unit=" ms",
    ),
    Goal("host reads per round", "compiled", "drafting for itself", "syncs_per_round", 1.0),
    Goal(
        "FLy at the real pair's trace, 32B shape, over the compiled target alone",
        "replay",
        "fly@15 (humaneval) on the 32b target",
        "speedup",
        2.5,
        smaller=False,
        unit="x",
    ),
    Goal(
        "Predicted Outputs at predict-draft@15, 7B shape, over plain compiled decoding",
        "replay",
        "predict-draft@15 (humaneval-edit) on the 7b target",
        "speedup",
        4.0,
        smaller=False,
        unit="x",
    ),
)
"""The goals of the GPU engine, read from the rows; the loop's two goals from the compiled
row of a target drafting for itself."""


def goal_rows(rows: Sequence[Row], *, on_cuda: bool) -> list[Row]:
    """One row per goal (:data:`GOALS`, and the same tokens of exact decoding, eager and
    compiled): met, missed or not run, with its figure. Off CUDA the figures are the CPU's,
    a rehearsal of the table, not of the goals."""
    where = "" if on_cuda else "; on the CPU: a rehearsal of this table, not a GPU figure"
    table = []
    for goal in GOALS:
        found = [r for r in rows if r.phase == goal.phase and goal.subject in r.subject]
        value = next(
            (r.values[goal.key] for r in found if r.values.get(goal.key) is not None), None
        )
        sign = "<=" if goal.smaller else ">="
        aim = f"goal {sign} {goal.bound:g}{goal.unit}"
        if value is None:
            why = found[0].status if found else "no such row"
            if found and found[0].status == "ok":
                why = "not measured on this device"
            result, values = f"NOT RUN ({why}); {aim}", {"met": None}
        else:
            met = value <= goal.bound if goal.smaller else value >= goal.bound
            result = f"{'MET' if met else 'MISSED'}: {value:.3g}{goal.unit}; {aim}"
            values = {"met": met, "value": value, "bound": goal.bound}
        subject = found[0].subject if found else goal.subject
        table.append(Row("goal", goal.name, "ok", result, f"from {subject}{where}", values))
    exact = [
        r
        for r in rows
        if r.phase == "same tokens"
        and (r.subject.startswith("spd") or "against eager" in r.subject)
    ]
    ran = [r for r in exact if r.status != "skipped"]
    if not ran:
        result, met = "NOT RUN; goal: every row the target's tokens", None
    else:
        met = len(ran) == len(exact) and all(r.status == "ok" for r in ran)
        same = sum(r.status == "ok" for r in ran)
        result = f"{'MET' if met else 'MISSED'}: {same}/{len(exact)} rows the target's tokens"
    table.append(
        Row(
            "goal",
            "exact SPD and prediction tokens = the target's, float32, eager and compiled",
            "ok",
            result,
            "the same tokens rows of exact decoding" + where,
            {"met": met},
        )
    )
    return table
