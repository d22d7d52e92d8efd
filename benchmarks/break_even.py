"""Where speculative decoding pays: the forward-cost ratio at which each measured method breaks
even with its backend's plain decoding.

A round drafting K tokens commits tau tokens (measured) and costs K draft forwards plus one
target forward over K + 1 tokens; plain decoding costs one one-token forward per token. With
``V(n)`` the target's forward over n tokens and ``d`` one draft forward, the round breaks even
where ``tau * V(1) = K * d + V(K + 1)``, that is where the machine's ratio
``V(K + 1) / V(1)`` is at most ``tau - K * d / V(1)``. This script reads tau and K from a
``flyspec bench`` report and ``V`` and ``d`` from ``flyspec bench --forward-cost`` reports of
each backend, and prints both ratios side by side: the break-even one, and the one measured.

    python benchmarks/break_even.py results/bench-llamacpp/bench.json \\
        --torch results/forward-cost-torch/forward-cost.json \\
        --llamacpp results/forward-cost-llamacpp/forward-cost.json

Methods whose name starts with ``llamacpp-`` are costed with the llama.cpp report, the others
with the torch one. The n-gram drafter's d is taken as 0; MLA's as the draft model's (an upper
bound: MLA saves draft forwards).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def forward_costs(path: Path) -> tuple[dict[int, float], float]:
    """The target's median ms per n new tokens, and the draft's one-token ms."""
    report = json.loads(Path(path).read_text())
    costs = report["forward_cost"]
    target = {row["new_tokens"]: row["median_ms"] for row in costs["target"]}
    draft = next(row["median_ms"] for row in costs["draft"] if row["new_tokens"] == 1)
    return target, draft


def break_even_rows(bench: dict, costs: dict[str, tuple[dict[int, float], float]]) -> list[dict]:
    rows = []
    for summary in bench["methods"]:
        tau, k = summary.get("tau"), summary.get("settings", {}).get("k")
        if tau is None or not isinstance(k, int):
            continue
        backend = "llamacpp" if summary["method"].startswith("llamacpp-") else "torch"
        if backend not in costs:
            continue
        target, draft_ms = costs[backend]
        if k + 1 not in target:
            continue
        draft_ms = 0.0 if summary["settings"].get("drafter") == "ngram" else draft_ms
        needed = tau - k * draft_ms / target[1]
        measured = target[k + 1] / target[1]
        rows.append(
            {
                "method": summary["method"],
                "k": k,
                "tau": tau,
                "draft_to_target": draft_ms / target[1],
                "break_even_ratio": needed,
                "measured_ratio": measured,
                "pays": measured < needed,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| method | K | tau | d / V(1) | breaks even at V(K+1)/V(1) <= | measured V(K+1)/V(1) "
        "| pays here |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['k']} | {row['tau']:.2f} | {row['draft_to_target']:.2f} "
            f"| {row['break_even_ratio']:.2f} | {row['measured_ratio']:.2f} "
            f"| {'yes' if row['pays'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="a flyspec bench report (bench.json)")
    parser.add_argument("--torch", help="forward-cost.json of the torch backend")
    parser.add_argument("--llamacpp", help="forward-cost.json of the llama.cpp backend")
    args = parser.parse_args()
    costs = {}
    if args.torch:
        costs["torch"] = forward_costs(Path(args.torch))
    if args.llamacpp:
        costs["llamacpp"] = forward_costs(Path(args.llamacpp))
    if not costs:
        parser.error("give --torch and/or --llamacpp")
    bench = json.loads(Path(args.bench).read_text())
    print(markdown(break_even_rows(bench, costs)))


if __name__ == "__main__":
    main()
