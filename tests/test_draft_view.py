"""benchmarks/draft_view.py: the table of what caps on the draft's confidence would refuse."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_view.py"
_SPEC = importlib.util.spec_from_file_location("draft_view", _PATH)
draft_view = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(draft_view)


def row(problem, outcome, confidence):
    return {
        "task": "humaneval",
        "problem_id": problem,
        "outcome": outcome,
        "draft_confidence": confidence,
    }


def test_caps_count_refused_tokens_and_fully_refused_lost_problems():
    rows = [
        row("p0", "lost", 0.95),
        row("p0", "lost", 0.6),
        row("p1", "lost", 0.8),
        row("p2", "unchanged", 0.2),
        row("p2", "unchanged", 0.75),
        row("p3", "gained", 0.4),
    ]
    table = {line.split(" | ")[0]: line for line in draft_view.summary(rows)[2:]}
    assert table["| draft confidence <= 0.5"].endswith("| 3/3 | 1/2 | 0/1 | 2/2 |")
    # At 0.7 the lost problem p0 keeps its token of confidence 0.6.
    assert table["| draft confidence <= 0.7"].endswith("| 2/3 | 1/2 | 0/1 | 1/2 |")
    assert table["| draft confidence <= 0.9"].endswith("| 1/3 | 0/2 | 0/1 | 0/2 |")
