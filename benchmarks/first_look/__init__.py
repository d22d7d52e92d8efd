"""The parts of ``benchmarks/gpu_first_look.py``, the first GPU figures in one run:

- ``run.py``: the run's settings and its phases in order (:class:`~first_look.run.FirstLook`);
- ``runner.py``: each phase run under the time limit, its failure a row, its compiles counted;
- ``timing.py``: how the phases time the device's work, with flyspec's one timer;
- ``models.py``: the random-weight models of the real, rehearsal and tiny shapes;
- ``plan.py``: what a run measures (sizes, targets, traces, block sizes, compile budgets);
- ``phases/``: one module per phase, each making its rows (its docstring says what they hold);
- ``table.py``: the rows, the Markdown table and the files written.

Importing it puts the tree's ``src`` first on ``sys.path``: flyspec comes from the tree, as on
a lent machine where it is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1]
ROOT = BENCHMARKS.parent
sys.path.insert(0, str(ROOT / "src"))


def load_script(name: str) -> ModuleType:
    """A script of ``benchmarks/`` (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
