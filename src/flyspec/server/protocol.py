"""The OpenAI-compatible wire format: request models, response bodies and the error body.

Requests are validated strictly (a number sent as a string is an error, as with OpenAI) and
unknown fields are refused, so a misspelt setting is reported instead of silently ignored.
Standard OpenAI fields the server does not implement are accepted only at their neutral value
(``presence_penalty: 0``, ``logprobs: null`` ...), and refused otherwise.

FLy settings ride as extra top-level fields: ``mode``, ``drafter``, ``k``, ``window``,
``theta`` (a number, or the string ``"inf"`` to switch loosening off), ``entropy``, plus
``top_k``. Their ranges are checked by :mod:`flyspec.config`, not here.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flyspec.stats import RequestStats

FinishReason = Literal["stop", "length"]


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code if code is not None or status_code != 400 else "invalid_value"
        self.type = type

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {message, type, param, code}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    """Fields shared by the completion and chat endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream_options: dict[str, Any] | None = None
    # FLy settings and top-k (extensions)
    mode: str | None = None
    drafter: str | None = None
    k: int | None = None
    window: int | None = None
    theta: float | None = None
    entropy: str | None = None
    top_k: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("theta", mode="before")
    @classmethod
    def _theta(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("inf", "infinity", "+inf"):
            return math.inf
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first standard field set to something not implemented."""
        if self.n not in (None, 1):
            return "n", "only n = 1 is supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported (send 0 or leave it out)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    @property
    def stop_strings(self) -> tuple[str, ...] | None:
        if self.stop is None:
            return None
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: Any = Field(description="a string, or a list of exactly one string")
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) != 1 or not isinstance(value[0], str):
                raise ValueError("prompt must be a string or a list of exactly one string")
            value = value[0]
        if not isinstance(value, str):
            raise ValueError("prompt must be a string or a list of exactly one string")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found:
            return found
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of = 1 is supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return None


class ChatMessage(BaseModel):
    """One message of a conversation; ``content`` may also be a list of text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for part in value:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise ValueError('content parts must be {"type": "text", "text": "..."}')
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("content must be a string or a list of text parts")

    def as_template_dict(self) -> dict[str, str]:
        """The message as the chat template expects it (``developer`` becomes ``system``)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found:
            return found
        if self.logprobs:
            return "logprobs", "logprobs is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
        return None


def new_id(prefix: str) -> str:
    """A random response id such as ``cmpl-1f2e...``."""
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def speculative(mode: str, stats: RequestStats, *, timed_out: bool = False) -> dict[str, Any]:
    """The ``speculative`` object: how the request was decoded, from ``RequestStats``."""
    figures = stats.as_dict()
    result: dict[str, Any] = {"mode": mode}
    for name in (
        "rounds",
        "tau",
        "drafted",
        "accepted",
        "loosely_accepted",
        "rejected",
        "seconds",
        "tokens_per_second",
    ):
        result[name] = figures[name]
    result["timed_out"] = timed_out
    return result


def response_body(
    *,
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: FinishReason,
    usage_: dict[str, int],
    speculative_: dict[str, Any],
) -> dict[str, Any]:
    """A finished ``chat.completion`` (``chat``) or ``text_completion``."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=finish_reason)
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
        "speculative": speculative_,
    }


def completion_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: FinishReason | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish_reason: FinishReason | None = None,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
