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

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from flyspec.config import MAX_SEED, DecodeConfig
from flyspec.errors import FlyspecError
from flyspec.server import protocol
from flyspec.server.access import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES
from flyspec.server.errors import (
    describe_validation_errors,
    generation_failed,
    install_error_handlers,
    shutting_down,
    unknown_model,
)
from flyspec.server.metrics import CONTENT_TYPE, ServerMetrics
from flyspec.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from flyspec.server.protocol import (
    CHAT,
    CLIENT_CLOSED,
    COMPLETIONS,
    MESSAGE_LIMIT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    clip,
)
from flyspec.server.requests import request_config
from flyspec.server.scheduler import GenerationQueue, Job, QueueFullError


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

    metrics = ServerMetrics()
    queue = GenerationQueue(
        engine,
        max_waiting=queue_size,
        on_finished=lambda job: metrics.observe_generation(job.config.mode, job.stats, job.outcome),
        executor=engine_executor,
    )
    metrics.read_queue(queue_length=lambda: queue.waiting, running=lambda: queue.running)
    started = int(time.time())

    server = _Server(
        engine=engine,
        defaults=defaults,
        model_name=model_name,
        queue=queue,
        request_timeout=request_timeout,
        max_messages=max_messages,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.start()
        queue.start()
        try:
            yield
        finally:
            await queue.close()
            server.close()

    app = FastAPI(
        title="flyspec",
        version=_version(),
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.defaults = defaults
    app.state.model_name = model_name
    # Starlette runs the middleware added last first: metrics see every answer, the key is
    # checked before the body is read, and the body is measured before any route runs.
    if max_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(
            APIKeyMiddleware, api_key=api_key, metrics_require_key=metrics_require_key
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    install_error_handlers(app)

    @app.post(COMPLETIONS, openapi_extra=_request_body_schema(CompletionRequest, COMPLETIONS))
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post(CHAT, openapi_extra=_request_body_schema(ChatCompletionRequest, CHAT))
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(model_name, started)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise unknown_model(model_id, model_name)
        return _model_card(model_name, started)

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

    return app


@dataclass(frozen=True)
class _Prepared:
    """A checked request: its model, prompt token ids and decoding settings."""

    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    config: DecodeConfig


class _Server:
    """Request handling shared by the two generation endpoints.

    Preparing a request (JSON parsing, validation, chat template, tokenizing) runs on one
    thread of its own, started by :meth:`start`: a big request then holds up the next
    request's preparation, never the event loop, and only one CPU core goes to it while the
    engine thread generates.
    """

    def __init__(
        self,
        *,
        engine,
        defaults: DecodeConfig,
        model_name: str,
        queue: GenerationQueue,
        request_timeout: float,
        max_messages: int | None,
    ) -> None:
        self.engine = engine
        self.defaults = defaults
        self.model_name = model_name
        self.queue = queue
        self.request_timeout = request_timeout
        self.max_messages = max_messages
        self._executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the preparation thread (from the app's lifespan)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyspec-prepare")

    def close(self) -> None:
        """Stop the preparation thread; preparations not yet started are dropped."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def handle(self, request: Request, *, chat: bool) -> Response:
        if self._executor is None:
            raise RuntimeError("the server is not started (run the app with its lifespan)")
        raw = await request.body()
        prepare = functools.partial(
            self.prepare, raw, content_type=request.headers.get("content-type"), chat=chat
        )
        prepared = await asyncio.get_running_loop().run_in_executor(self._executor, prepare)
        body, prompt_ids, config = prepared.body, prepared.prompt_ids, prepared.config
        try:
            job = self.queue.submit(prompt_ids, config, timeout=self.request_timeout)
        except QueueFullError:
            raise APIError(
                429,
                f"the server is busy: {self.queue.waiting} requests are already waiting "
                f"(queue size {self.queue.max_waiting}); retry later",
                type="requests",
                code="rate_limit_exceeded",
            ) from None
        response_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        created = protocol.now()
        if body.stream:
            events = self._stream(job, response_id, created, chat=chat)
            return _JobStreamingResponse(events, on_close=lambda: self.queue.cancel(job))
        try:
            text = await _wait_unless_disconnected(request, job)
        finally:
            self.queue.cancel(job)  # no-op once the job has ended
        if text is None:
            return Response(status_code=CLIENT_CLOSED)
        if job.outcome == "error":
            raise generation_failed(job)
        if job.outcome == "cancelled":
            raise shutting_down()
        return JSONResponse(
            protocol.response_body(
                chat=chat,
                request_id=response_id,
                created=created,
                model=self.model_name,
                text=text,
                finish_reason=job.finish_reason or "length",
                usage_=protocol.usage(len(job.prompt_ids), job.completion_tokens),
                speculative_=protocol.speculative(
                    job.config.mode, job.stats, timed_out=job.timed_out
                ),
            )
        )

    def prepare(self, raw: bytes, *, content_type: str | None, chat: bool) -> _Prepared:
        """Parse and check a request body and turn it into prompt token ids and decoding
        settings (APIError for anything the client should fix). Runs off the event loop."""
        model = ChatCompletionRequest if chat else CompletionRequest
        try:
            body = protocol.parse_request(
                raw,
                content_type=content_type,
                model=model,
                max_messages=self.max_messages if chat else None,
            )
        except ValidationError as error:
            message, param, code = describe_validation_errors(error.errors())
            raise APIError(400, message, param=param, code=code) from None
        unsupported = body.unsupported()
        if unsupported is not None:
            param, message = unsupported
            raise APIError(400, message, param=param, code="unsupported_parameter")
        if body.model is not None and body.model != self.model_name:
            raise unknown_model(body.model, self.model_name)
        if isinstance(body, ChatCompletionRequest):
            max_tokens = body.requested_max_tokens
            max_tokens_param = (
                "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            )
        else:
            max_tokens, max_tokens_param = body.max_tokens, "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                400,
                f"{max_tokens_param} must be at least 1, got {max_tokens}",
                param=max_tokens_param,
            )
        if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
            raise APIError(400, f"seed must be in [0, 2**63 - 1], got {body.seed}", param="seed")

        prompt_ids = self._encode(body, chat=chat)
        prompt_param = "messages" if chat else "prompt"
        limit = self.engine.context_length
        room = limit - len(prompt_ids)
        if max_tokens is None:
            if room < 1:
                raise APIError(
                    400,
                    f"this model's maximum context length is {limit} tokens, and the prompt "
                    f"already has {len(prompt_ids)}",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            max_tokens = min(self.defaults.max_new_tokens, room)
        elif len(prompt_ids) + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} "
                f"for the completion)",
                param=max_tokens_param if room >= 1 else prompt_param,
                code="context_length_exceeded",
            )
        config = request_config(self.defaults, body, max_new_tokens=max_tokens)
        if config.uses_draft_model and getattr(self.engine, "draft_model", None) is None:
            raise APIError(
                400,
                f"mode {config.mode!r} with the {config.drafter!r} drafter needs a draft model, "
                "and this server has none; use mode 'target' or drafter 'ngram'",
                param="drafter",
            )
        return _Prepared(body=body, prompt_ids=prompt_ids, config=config)

    def _encode(self, body: CompletionRequest | ChatCompletionRequest, *, chat: bool) -> list[int]:
        try:
            if isinstance(body, ChatCompletionRequest):
                if not body.messages:
                    raise APIError(400, "messages must not be empty", param="messages")
                return self.engine.encode_messages([m.as_template_dict() for m in body.messages])
            return self.engine.encode(body.prompt)
        except APIError:
            raise
        except FlyspecError as error:
            raise APIError(
                400, clip(str(error), MESSAGE_LIMIT), param="messages" if chat else "prompt"
            ) from None
        except Exception as error:  # a chat template that raises on this conversation
            if chat and type(error).__module__.startswith("jinja2"):
                raise APIError(
                    400,
                    f"the chat template refused these messages: {clip(str(error), MESSAGE_LIMIT)}",
                    param="messages",
                ) from None
            raise

    async def _stream(
        self, job: Job, response_id: str, created: int, *, chat: bool
    ) -> AsyncIterator[str]:
        common = {"request_id": response_id, "created": created, "model": self.model_name}
        if chat:
            yield _sse(protocol.chat_chunk(**common, delta={"role": "assistant", "content": ""}))
        async for piece in job.pieces():
            if chat:
                yield _sse(protocol.chat_chunk(**common, delta={"content": piece}))
            else:
                yield _sse(protocol.completion_chunk(**common, text=piece))
        if job.outcome == "error":
            yield _sse(generation_failed(job).body())
        elif job.outcome == "cancelled":
            yield _sse(shutting_down().body())
        else:
            finish_reason = job.finish_reason or "length"
            if chat:
                final = protocol.chat_chunk(**common, delta={}, finish_reason=finish_reason)
            else:
                final = protocol.completion_chunk(**common, text="", finish_reason=finish_reason)
            final["usage"] = protocol.usage(len(job.prompt_ids), job.completion_tokens)
            final["speculative"] = protocol.speculative(
                job.config.mode, job.stats, timed_out=job.timed_out
            )
            yield _sse(final)
        yield "data: [DONE]\n\n"


class _JobStreamingResponse(StreamingResponse):
    """Server-sent events whose job is cancelled however the response ends (finished,
    client gone before or during streaming, server shutting down)."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _wait_unless_disconnected(request: Request, job: Job) -> str | None:
    """The job's text, or None when the client disconnected first."""
    text_task = asyncio.ensure_future(job.wait())
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({text_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        return text_task.result() if text_task in done else None
    finally:
        for task in (text_task, gone_task):
            task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


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


# ---------------------------------------------------------------- errors
