"""The pure-ASGI middlewares in front of the routes: request metrics, the API key and the
body-size limit (413)."""

from __future__ import annotations

import hmac
import json
import math
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flyspec.server.metrics import ServerMetrics
from flyspec.server.protocol import (
    CLIENT_CLOSED,
    ENDPOINTS,
    GENERATION_ENDPOINTS,
    INFILL,
    APIError,
)


class MetricsMiddleware:
    """Counts every answered request by endpoint and status; times generation requests."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        if path.startswith("/v1/models/"):
            endpoint = "/v1/models"
        started = time.perf_counter()
        status = 500
        disconnected = False
        completed = False

        async def send_status(message: Message) -> None:
            nonlocal status, completed
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True
            await send(message)

        async def receive_watch() -> Message:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
            return message

        try:
            await self.app(scope, receive_watch, send_status)
        finally:
            if disconnected and not completed and status == 200:
                status = CLIENT_CLOSED  # a stream the client left before its end
            seconds = time.perf_counter() - started if path in GENERATION_ENDPOINTS else None
            if seconds is not None and not math.isfinite(seconds):
                seconds = None
            self.metrics.observe_request(endpoint, status, seconds)


# ---------------------------------------------------------------- key and size middlewares


async def _send_error(
    send: Send, error: APIError, *, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """Answer ``error`` straight over ASGI (before any route has run)."""
    body = json.dumps(error.body()).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode("ascii")),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Answers 401 unless ``Authorization: Bearer <key>`` carries the key, on every ``/v1``
    path (unknown ones too, so nothing is learnt without the key), on ``/infill`` and, when
    asked, on ``/metrics``. The key is compared in constant time."""

    def __init__(self, app: ASGIApp, *, api_key: str, metrics_require_key: bool) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")
        self.metrics_require_key = metrics_require_key

    def protects(self, path: str) -> bool:
        if path == "/v1" or path.startswith("/v1/") or path == INFILL:
            return True
        return self.metrics_require_key and path == "/metrics"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        supplied = _bearer_token(scope)
        if supplied is not None and hmac.compare_digest(supplied, self.key):
            await self.app(scope, receive, send)
            return
        message = (
            "no API key: send it as 'Authorization: Bearer <key>'"
            if supplied is None
            else "incorrect API key provided"
        )
        await _send_error(
            send,
            APIError(401, message, code="invalid_api_key"),
            headers=((b"www-authenticate", b"Bearer"),),
        )


def _bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's ``Authorization: Bearer ...`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class BodyLimitMiddleware:
    """Answers 413 for a request body over ``max_body_bytes``: at once from its
    Content-Length, else (chunked) as soon as the bytes received pass the limit.

    The body is read here in full before the app runs, then handed on in one message; what
    the client sends after it (a disconnect) passes through unchanged. The 413 does not ask
    to close the connection: uvicorn then reads and drops the rest of the body, so the client,
    still sending, gets the answer instead of a reset connection.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def too_large(self, size: int | None) -> APIError:
        """The 413: ``size`` is the declared Content-Length, None for a chunked body."""
        limit = f"this server's limit of {self.max_body_bytes} bytes"
        told = f"has {size} bytes, more than {limit}" if size is not None else f"exceeds {limit}"
        return APIError(
            413,
            f"the request body {told} (flyspec serve --max-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_error(send, self.too_large(declared))
            return
        chunks: list[bytes] = []
        size = 0
        last: Message | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                last = message  # the client left while sending
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, self.too_large(None))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        first: Message = last or {"type": "http.request", "body": b"".join(chunks)}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
