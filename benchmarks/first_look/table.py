"""The table the run makes: a :class:`Row` per line, the figures' formats, the Markdown and the
files written (``gpu_first_look.json`` and ``gpu_first_look.md``), and the progress lines on
stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Row:
    """One line of the table: a phase, what it measured, ``ok``/``failed``/``skipped``, the
    headline and its detail, and the numbers behind them (JSON only)."""

    phase: str
    subject: str
    status: str
    result: str
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)


class PhaseSkipped(Exception):
    """A phase not run, with the reason (a row marked skipped)."""


def log(message: str) -> None:
    print(f"[gpu_first_look] {message}", file=sys.stderr, flush=True)


def fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant digits."""
    ms = 1000 * seconds
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def fmt_count(value: float, unit: str) -> str:
    """``value`` with three significant digits and a decimal prefix: ``1.54 GB``; a count of
    parameters in billions or millions: ``1.54 B parameters``."""
    if unit == "parameters":
        return f"{value / 1e9:.3g} B {unit}" if value >= 1e8 else f"{value / 1e6:.3g} M {unit}"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def compiled_suffix(forward_path: str) -> str:
    return ", compiled" if forward_path == "compiled" else ""


def sync_text(device: torch.device, syncs: float | None) -> str:
    if syncs is not None:
        return f"{syncs:.1f}"
    return "not counted on the CPU" if device.type != "cuda" else "not reported by torch"


def describe(env: dict) -> str:
    shapes = {
        "tiny": "; TINY shapes (a check of the script, not figures)",
        "rehearsal": "; REHEARSAL shapes (the real layers, heads and vocabularies, narrowed: "
        "a rehearsal of the GPU run, not figures)",
    }
    return (
        f"{env['dtype']}; torch {env['torch']}, transformers {env['transformers']}, Python "
        f"{env['python']}; commit {env['commit'] or 'unknown'}; {env['date']}"
        + shapes.get(env.get("shapes", "real"), "")
    )


def markdown(rows: Sequence[Row]) -> str:
    """The table: one line per row, a failed or skipped row's reason in its result."""
    lines = ["| phase | subject | result | detail |", "|---|---|---|---|"]
    for row in rows:
        result = row.result if row.status == "ok" else f"{row.status.upper()}: {row.result}"
        cells = (row.phase, row.subject, result, row.detail)
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def write_outputs(folder: Path, env: dict, rows: Sequence[Row]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    report = {"script": "benchmarks/gpu_first_look.py", "environment": env}
    report["rows"] = [asdict(row) for row in rows]
    (folder / "gpu_first_look.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    partial = "" if env.get("complete") else " PARTIAL: the rows so far of a run not ended."
    (folder / "gpu_first_look.md").write_text(
        f"# First GPU figures\n\n{env['device_description']}; {describe(env)}; "
        f"{env['elapsed_s']} s.{partial}\n\n{markdown(rows)}\n"
    )
