"""matplotlib, where it is installed (the ``plot`` extra): reports draw their plots with it and
are written without them where it is missing."""

from __future__ import annotations

import importlib.util
import sys


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (with a note on stderr)
    where matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "flyspec: note: matplotlib is not installed, so no plots are drawn "
            "(pip install 'flyspec[plot]')",
            file=sys.stderr,
        )
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
