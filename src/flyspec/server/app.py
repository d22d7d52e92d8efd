"""The FastAPI application: OpenAI-compatible completions and chat, with FLy metrics.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics``. Every error is answered with OpenAI's error body; validation errors use
status 400 (not FastAPI's 422).

The work that grows with a request stays off the event loop: the generation endpoints read
their body, then parse, validate, template and tokenize it on one preparation thread, and
generation runs on the engine thread (:mod:`flyspec.server.scheduler`), so ``/health``
answers while a big request is being prepared. In front of the routes, pure-ASGI middlewares
check the API key (``/v1`` routes, and ``/metrics`` when asked) and then the body size (413).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from flyspec.config import DecodeConfig
from flyspec.server.access import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES
from flyspec.server.errors import (
    install_error_handlers,
    unknown_model,
)
from flyspec.server.generation import GenerationHandler
from flyspec.server.metrics import CONTENT_TYPE, ServerMetrics
from flyspec.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from flyspec.server.protocol import (
    CHAT,
    COMPLETIONS,
    INFILL,
    ChatCompletionRequest,
    CompletionRequest,
    InfillRequest,
)
from flyspec.server.scheduler import GenerationQueue


def create_app(
    engine,
    *,
    defaults: DecodeConfig,
    model_name: str,
    queue_size: int = 8,
    request_timeout: float = 600.0,
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    max_messages: int | None = DEFAULT_MAX_MESSAGES,
    api_key: str | None = None,
    metrics_require_key: bool = False,
    docs: bool = False,
    engine_executor: ThreadPoolExecutor | None = None,
) -> FastAPI:
    """The server app for one loaded :class:`~flyspec.engine.Engine`.

    ``defaults``: decoding settings of requests that do not override them (``max_new_tokens``
    is the default ``max_tokens``). ``queue_size``: requests that may wait while one runs;
    one more is answered 429. ``request_timeout``: seconds from arrival (waiting included)
    after which a generation is stopped and answered with what it has, ``finish_reason:
    "length"`` and ``speculative.timed_out: true``.

    ``max_body_bytes``: larger request bodies are answered 413 (None: no limit).
    ``max_messages``: chat requests with more messages are answered 400 (None: no limit).
    ``api_key``: when set, every ``/v1`` route (and ``/metrics`` with ``metrics_require_key``)
    needs ``Authorization: Bearer <api_key>``, else 401. ``docs``: serve ``/docs``,
    ``/redoc`` and ``/openapi.json`` (off by default: they describe the server to anyone).
    ``engine_executor``: the single thread that loaded the engine, to generate on
    (:func:`~flyspec.server.scheduler.engine_thread`: torch runs faster when one thread
    only ever calls it); without one the app starts its own engine thread.
    """
    _check_settings(
        queue_size=queue_size,
        request_timeout=request_timeout,
        max_body_bytes=max_body_bytes,
        max_messages=max_messages,
        api_key=api_key,
        metrics_require_key=metrics_require_key,
    )
    metrics = ServerMetrics()
    queue = _metered_queue(engine, metrics, max_waiting=queue_size, executor=engine_executor)
    started = int(time.time())
    server = GenerationHandler(
        engine=engine,
        defaults=defaults,
        model_name=model_name,
        queue=queue,
        request_timeout=request_timeout,
        max_messages=max_messages,
    )
    app = _new_app(_lifespan(server, queue), docs=docs)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.defaults = defaults
    app.state.model_name = model_name
    _add_middlewares(
        app,
        metrics,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        metrics_require_key=metrics_require_key,
    )
    install_error_handlers(app)
    _add_generation_routes(app, server)
    _add_model_routes(app, model_name, created=started)
    _add_status_routes(app, model_name, queue, queue_size=queue_size, metrics=metrics)
    return app


def _check_settings(
    *,
    queue_size: int,
    request_timeout: float,
    max_body_bytes: int | None,
    max_messages: int | None,
    api_key: str | None,
    metrics_require_key: bool,
) -> None:
    """ValueError on a setting :func:`create_app` cannot run with."""
    if queue_size < 0:
        raise ValueError(f"queue_size must be >= 0, got {queue_size}")
    if not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
    for name, limit in (("max_body_bytes", max_body_bytes), ("max_messages", max_messages)):
        if limit is not None and limit < 1:
            raise ValueError(f"{name} must be >= 1 (or None for no limit), got {limit}")
    if api_key is not None and (not api_key or api_key != api_key.strip()):
        raise ValueError("api_key must be non-empty, without surrounding whitespace (None: no key)")
    if metrics_require_key and api_key is None:
        raise ValueError("metrics_require_key needs an api_key")


def _metered_queue(
    engine, metrics: ServerMetrics, *, max_waiting: int, executor: ThreadPoolExecutor | None
) -> GenerationQueue:
    """The generation queue, each finished generation and the queue's length counted in
    ``metrics``."""
    queue = GenerationQueue(
        engine,
        max_waiting=max_waiting,
        on_finished=lambda job: metrics.observe_generation(job.config.mode, job.stats, job.outcome),
        executor=executor,
    )
    metrics.read_queue(queue_length=lambda: queue.waiting, running=lambda: queue.running)
    return queue


def _lifespan(server: GenerationHandler, queue: GenerationQueue):
    """The app's lifespan: the preparation and engine threads run while the app does."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.start()
        queue.start()
        try:
            yield
        finally:
            await queue.close()
            server.close()

    return lifespan


def _new_app(lifespan, *, docs: bool) -> FastAPI:
    """The bare app, its documentation routes served only with ``docs``."""
    return FastAPI(
        title="flyspec",
        version=_version(),
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )


def _add_middlewares(
    app: FastAPI,
    metrics: ServerMetrics,
    *,
    max_body_bytes: int | None,
    api_key: str | None,
    metrics_require_key: bool,
) -> None:
    """The metrics, API key and body size middlewares (the last two where asked)."""
    # Starlette runs the middleware added last first: metrics see every answer, the key is
    # checked before the body is read, and the body is measured before any route runs.
    if max_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(
            APIKeyMiddleware, api_key=api_key, metrics_require_key=metrics_require_key
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)


def _add_generation_routes(app: FastAPI, server: GenerationHandler) -> None:
    """``POST /v1/completions``, ``POST /v1/chat/completions`` and llama-server's
    ``POST /infill``."""

    @app.post(COMPLETIONS, openapi_extra=_request_body_schema(CompletionRequest, COMPLETIONS))
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post(CHAT, openapi_extra=_request_body_schema(ChatCompletionRequest, CHAT))
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.post(INFILL, openapi_extra=_request_body_schema(InfillRequest, INFILL))
    async def infill(request: Request) -> Response:
        return await server.handle_infill(request)


def _add_model_routes(app: FastAPI, model_name: str, *, created: int) -> None:
    """``GET /v1/models`` and ``GET /v1/models/{id}``: the one model served."""

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise unknown_model(model_id, model_name)
        return _model_card(model_name, created)


def _add_status_routes(
    app: FastAPI,
    model_name: str,
    queue: GenerationQueue,
    *,
    queue_size: int,
    metrics: ServerMetrics,
) -> None:
    """``GET /health`` and ``GET /metrics`` (Prometheus' text format)."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "queue": {"waiting": queue.waiting, "running": queue.running, "size": queue_size},
        }

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _model_card(model_name: str, created: int) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "flyspec"}


def _request_body_schema(model: type[BaseModel], path: str) -> dict[str, Any]:
    """OpenAPI's ``requestBody`` for a route that parses its own body: the model's JSON
    schema, its ``$defs`` referenced by JSON pointers into the operation itself."""
    escaped = path.replace("~", "~0").replace("/", "~1")
    pointer = f"#/paths/{escaped}/post/requestBody/content/application~1json/schema/$defs/"
    schema = model.model_json_schema(ref_template=pointer + "{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _version() -> str:
    from flyspec import __version__

    return __version__
