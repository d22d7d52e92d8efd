"""An OpenAI-compatible HTTP server with per-request speculative metrics.

The app lives in :mod:`flyspec.server.app` (``create_app``) and needs the ``serve`` extra
(fastapi, uvicorn); ``flyspec serve`` (:mod:`flyspec.cli.serve`) builds and runs it.
"""
