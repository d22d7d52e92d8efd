"""``projection``: not a measurement. FLy's and exact SPD's speedup over the target alone, from
the tau flyspec measured on the real pair on a CPU (``gpu_configs/measured_tau.json``) and the
measured costs, with ``benchmarks/break_even.py``'s cost of a round (``K * d + V(K+1)`` for tau
tokens, against ``V(1)`` a token); once from the forwards alone, once with the engine's
measured time per target token and the loop's overhead per round added."""

from __future__ import annotations

import json

from .. import load_script
from ..models import CONFIGS
from ..table import Row

TAU_FILE = CONFIGS / "measured_tau.json"


def load_tau() -> list[dict]:
    """The tau figures of ``measured_tau.json``, each with its source."""
    runs = json.loads(TAU_FILE.read_text())["runs"]
    return [{**entry, "source": run["source"]} for run in runs for entry in run["tau"]]


def projection_rows(
    name: str,
    target_costs: dict[int, float],
    draft_ms: float,
    *,
    engine_ms: float | None,
    overhead_ms: dict[int, float],
) -> list[Row]:
    """FLy's and SPD's projected speedup on target ``name``: ``benchmarks/break_even.py``'s
    round cost (``K * d + V(K+1)`` for tau tokens, against ``V(1)`` a token) from the measured
    forwards; then with the engine's time per target token and the loop's overhead per round."""
    break_even = load_script("break_even")
    rows = []
    for entry in load_tau():
        method, k, tau = entry["method"], entry["k"], entry["tau"]
        commit = entry["source"]["commit"]
        subject = f"{method} K={k} on the {name} target (tau {tau} from {commit})"
        if k + 1 not in target_costs:
            rows.append(Row("projection", subject, "skipped", f"no V({k + 1}) measured"))
            continue
        bench = {"methods": [{"method": f"{method}@{k}", "tau": tau, "settings": {"k": k}}]}
        (costed,) = break_even.break_even_rows(bench, {"torch": (target_costs, draft_ms)})
        forwards_only = tau / (k * costed["draft_to_target"] + costed["measured_ratio"])
        values = {**costed, "speedup_forwards_only": forwards_only, "source": entry["source"]}
        result = f"{forwards_only:.2f}x from the forwards"
        if engine_ms is not None and k in overhead_ms:
            round_ms = k * draft_ms + target_costs[k + 1] + overhead_ms[k]
            values["speedup_with_loop"] = tau * engine_ms / round_ms
            result += f", {values['speedup_with_loop']:.2f}x with the loop"
        assumed = "" if name == "1.5b" else "; assumes the 0.5B drafts as well for this target"
        rows.append(
            Row(
                "projection",
                subject,
                "ok",
                result,
                f"PROJECTED, not measured: d/V(1) {costed['draft_to_target']:.2f}, "
                f"V({k + 1})/V(1) {costed['measured_ratio']:.2f}, "
                f"{break_even_text(k, tau, costed['draft_to_target'])}; tau of the default "
                f"pair on a CPU{assumed}",
                values,
            )
        )
    return rows


def break_even_text(k: int, tau: float, draft_to_target: float) -> str:
    """Where a round of ``k`` drafts committing ``tau`` tokens breaks even
    (``V(K+1)/V(1) <= tau - K * d/V(1)``), or why it cannot: a verify forward costs at least
    a one-token one, so a bound under 1 is out of reach."""
    needed = tau - k * draft_to_target
    if needed >= 1:
        return f"breaks even at V({k + 1})/V(1) <= {needed:.2f}"
    return (
        f"cannot break even: its {k} drafts cost {k * draft_to_target:.2f} V(1) and the verify "
        f"at least V(1), for {tau} tokens"
    )
