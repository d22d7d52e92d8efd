"""The bench's plots: speedup bars, tokens-per-round histograms, acceptance by draft position."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

SPEEDUP_PLOT = "speedup.png"
ROUNDS_PLOT = "tokens-per-round.png"
POSITION_PLOT = "acceptance-by-position.png"


def has_per_position(summary: Mapping) -> bool:
    """Whether a method drafted, so that it has an acceptance at some draft position."""
    return any(p is not None for p in summary.get("per_position_acceptance") or ())


def write_plots(report: Mapping, folder: Path) -> list[str]:
    """Speedup bars, tokens-per-round histograms and acceptance by position, as PNG files."""
    from flyspec.support.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return []

    summaries = report["methods"]
    written = []

    def save(figure, name: str) -> None:
        figure.tight_layout()
        figure.savefig(folder / name, dpi=120)
        plt.close(figure)
        written.append(name)

    figure, axes = plt.subplots(figsize=(1.0 + 0.9 * len(summaries), 3.6))
    names = [s["method"] for s in summaries]
    values = [s["speedup"] if s["speedup"] is not None else 0.0 for s in summaries]
    colours = [
        {"hf": "tab:gray", "vllm": "tab:orange"}.get(s["kind"], "tab:blue") for s in summaries
    ]
    bars = axes.bar(names, values, color=colours)
    axes.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=8)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_ylabel(f"speedup over {report['config'].get('baseline', 'target')}")
    axes.set_title(f"{report['config']['dataset']}: speedup (mean tokens/s ratio)")
    axes.tick_params(axis="x", rotation=30)
    save(figure, SPEEDUP_PLOT)

    speculative = [s for s in summaries if s.get("tokens_per_round_histogram") and s["drafted"]]
    by_position = [s for s in summaries if has_per_position(s)]
    if speculative:
        figure, axes = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(speculative)
        for index, s in enumerate(speculative):
            counts = s["tokens_per_round_histogram"]
            total = sum(counts) or 1
            offset = (index - (len(speculative) - 1) / 2) * width
            positions = [n + offset for n in range(len(counts))]
            axes.bar(
                positions,
                [c / total for c in counts],
                width=width,
                label=f"{s['method']} (tau {s['tau']:.2f})",
            )
        axes.set_xticks(range(0, len(counts), 1 if len(counts) <= 18 else 2))
        axes.set_xlabel("tokens emitted in a round")
        axes.set_ylabel("share of rounds")
        axes.set_title("tokens per round (tau histogram)")
        axes.legend(fontsize=8)
        save(figure, ROUNDS_PLOT)

    if by_position:
        figure, axes = plt.subplots(figsize=(7, 3.6))
        for s in by_position:
            rates = s["per_position_acceptance"]
            points = [(i, p) for i, p in enumerate(rates) if p is not None]
            axes.plot([i for i, _ in points], [p for _, p in points], marker="o", label=s["method"])
        axes.set_xlabel("draft position")
        axes.set_ylabel("P(kept | drafted)")
        axes.set_ylim(0, 1.02)
        axes.set_title("acceptance by draft position")
        axes.legend(fontsize=8)
        save(figure, POSITION_PLOT)
    return written
