"""Errors as OpenAI's error bodies: the exception handlers, FastAPI's validation errors
in one message, and the errors of generation."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flyspec.server import protocol
from flyspec.server.protocol import (
    MESSAGE_LIMIT,
    APIError,
    clip,
    quote,
)
from flyspec.server.scheduler import Job

logger = logging.getLogger("flyspec.server")


def generation_failed(job: Job) -> APIError:
    return APIError(
        500,
        f"generation failed: {type(job.error).__name__}: {clip(str(job.error), MESSAGE_LIMIT)}",
        type="server_error",
        code="generation_failed",
    )


def shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down", type="server_error", code="server_shutting_down"
    )


def unknown_model(requested: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model {quote(requested)} does not exist; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status_code in (429, 503) else None
        return JSONResponse(error.body(), status_code=error.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param, code = describe_validation_errors(error.errors())
        return JSONResponse(protocol.error_body(message, param=param, code=code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        path = clip(request.url.path)
        if error.status_code == 404:
            message = f"no such endpoint: {request.method} {path}"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {path}"
        else:
            message = clip(str(error.detail), MESSAGE_LIMIT)
        return JSONResponse(
            protocol.error_body(message, code=code),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error", exc_info=error)
        return JSONResponse(
            protocol.error_body(
                f"internal error: {type(error).__name__}", type="server_error", code="internal"
            ),
            status_code=500,
        )


def describe_validation_errors(errors: Any) -> tuple[str, str | None, str | None]:
    """``(message, param, code)`` for FastAPI's validation errors: the first error decides
    ``param`` and ``code``; the message names every problem."""
    errors = list(errors)
    if not errors:
        return "invalid request", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        position = first.get("loc", (None, None))[-1]
        return (
            f"the request body is not valid JSON ({detail} at character {position})",
            None,
            "invalid_json",
        )
    messages: list[str] = []
    params: list[str] = []
    codes: list[str] = []
    for error in errors:
        loc = [part for part in error.get("loc", ()) if part != "body"]
        # Drop union branch names such as 'str' / 'list[str]' that pydantic adds to locations.
        loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
        param = ".".join(clip(str(p)) for p in loc) or None
        kind = error.get("type")
        text = clip(
            str(error.get("msg", "invalid value")).removeprefix("Value error, "), MESSAGE_LIMIT
        )
        code = "invalid_type" if str(kind).endswith("_type") else "invalid_value"
        if kind == "missing":
            code = "missing_required_parameter"
            entry = f"{param}: required field is missing" if param else "a JSON body is required"
        elif kind == "extra_forbidden":
            code = "unknown_parameter"
            entry = f"unrecognized request argument supplied: {param}"
        elif kind == "model_attributes_type" and param is None:
            entry = "the request body must be a JSON object"
        elif param and not text.startswith(f"{param} "):
            entry = f"{param}: {text}"
        else:
            entry = text
        if entry not in messages:
            messages.append(entry)
        if param and param not in params:
            params.append(param)
        codes.append(code)
    return "; ".join(messages), (params[0] if params else None), codes[0]


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


# ---------------------------------------------------------------- metrics middleware
