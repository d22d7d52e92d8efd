"""``flyspec serve``: an OpenAI-compatible HTTP server with per-request speculative metrics.

Importing this package is cheap (argparse only); the app itself lives in
:mod:`flyspec.server.app` (``create_app``), which needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

from flyspec.server.cli import add_parser, run_serve

__all__ = ["add_parser", "run_serve"]
