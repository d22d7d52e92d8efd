"""A request with a ``prediction`` (OpenAI's Predicted Outputs) to vLLM's server gets one clear
error: vLLM has no Predicted Outputs, and would otherwise ignore the field and answer slowly.

``flyspec serve --engine vllm`` adds :class:`RefusePredictions` to vLLM's app through vLLM's own
``--middleware`` option. Pure ASGI, standard library only (it runs in vLLM's process).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GUARDED_PATHS = ("/v1/chat/completions", "/v1/completions")
MIDDLEWARE = f"{__name__}.RefusePredictions"
"""The import path given to vLLM's ``--middleware``."""
MESSAGE = (
    "prediction (Predicted Outputs) is not supported with --engine vllm: vLLM has no Predicted "
    "Outputs. Serve with flyspec's own engine (flyspec serve without --engine vllm), or send "
    "the request without a prediction"
)


class RefusePredictions:
    """Answers 400 to a generation request whose JSON body sets ``prediction``; passes every
    other request on unchanged (its body replayed to the app as it arrived)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if not scope.get("path", "").rstrip("/").endswith(GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if _sets_prediction(body):
            await _refuse(send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _sets_prediction(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False  # vLLM reports a body that is not JSON itself
    return isinstance(data, dict) and data.get("prediction") is not None


async def _refuse(send: Send) -> None:
    payload = json.dumps(
        {
            "error": {
                "message": MESSAGE,
                "type": "invalid_request_error",
                "param": "prediction",
                "code": "unsupported_parameter",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
