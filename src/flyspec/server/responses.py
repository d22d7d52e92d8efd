"""The OpenAI-compatible response bodies: whole responses, streamed chunks, usage, and the
``speculative`` object that says how a request was decoded."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from flyspec.decoding.stats import RequestStats
from flyspec.server.protocol import FinishReason
from flyspec.server.scheduler import TokenRecord


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


def jobs_usage(jobs: Sequence) -> dict[str, Any]:
    """The usage of the finished :class:`~flyspec.server.scheduler.Job` s of one request (its
    choices, one after another: the prompt counted once), with the prompt tokens the first
    choice read from the prompt cache (``prompt_tokens_details.cached_tokens``); with a
    prediction,
    ``completion_tokens_details`` says how many of the tokens drafted from it were kept
    (``accepted_prediction_tokens``) and how many were not (``rejected_prediction_tokens``)."""
    first = jobs[0]
    result: dict[str, Any] = usage(len(first.prompt_ids), sum(j.completion_tokens for j in jobs))
    # The prompt positions read from the prompt cache, not computed (OpenAI's field).
    result["prompt_tokens_details"] = {"cached_tokens": first.stats.cached_prompt_tokens}
    if first.prediction_ids is not None:
        result["completion_tokens_details"] = {
            # A stop string may cut the text inside a round whose tokens were all kept.
            "accepted_prediction_tokens": sum(
                min(j.stats.accepted_prediction_tokens, j.completion_tokens) for j in jobs
            ),
            "rejected_prediction_tokens": sum(j.stats.rejected_prediction_tokens for j in jobs),
        }
    return result


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
        "deferrals_confirmed",
        "deferrals_rolled_back",
    ):
        result[name] = figures[name]
    result["timed_out"] = timed_out
    return result


def choice_body(
    *,
    chat: bool,
    index: int,
    text: str | None,
    finish_reason: FinishReason,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One finished choice of a ``chat.completion`` (``chat``; with the ``tool_calls`` the
    model made, where it made some) or ``text_completion``."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            choice["message"]["tool_calls"] = tool_calls
    else:
        choice["text"] = text
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    return choice


def with_calls(finish_reason: FinishReason, calls: Sequence[Any]) -> FinishReason:
    """OpenAI's ``tool_calls`` for an answer that ended on its own after calling tools."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def call_deltas(text: str, new_calls: Sequence[Any], calls: Sequence[Any]) -> list[dict]:
    """The streamed deltas of released ``text`` and of ``new_calls``, the last of ``calls``
    (each call whole in one delta, indexed among the choice's calls)."""
    deltas: list[dict] = [{"content": text}] if text else []
    first = len(calls) - len(new_calls)
    deltas += [{"tool_calls": [call.as_dict(index=first + i)]} for i, call in enumerate(new_calls)]
    return deltas


def response_body(
    *,
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, int],
    speculative_: dict[str, Any],
) -> dict[str, Any]:
    """A finished ``chat.completion`` (``chat``) or ``text_completion``."""
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "speculative": speculative_,
    }


def chat_logprobs(records: Sequence[TokenRecord], tokenizer) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each token's text, log-probability, UTF-8 bytes and
    likeliest alternatives, and how the token was obtained (``origin``, an extension:
    ``loose`` for a token FLy kept loosely)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {
            **entry(record.token, record.logprob.logprob),
            "top_logprobs": [entry(token, value) for token, value in record.logprob.top],
            "origin": record.origin,
        }
        for record in records
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    records: Sequence[TokenRecord], tokenizer, *, text_offset: int = 0
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (the legacy shape): the tokens' texts, their
    log-probabilities, their alternatives as ``{text: logprob}``, where each token's text
    starts in the answer (from ``text_offset``), and (an extension) each token's origin. An
    echoed prompt's tokens come first (origin ``prompt``), the first with nulls, as
    OpenAI's."""
    tokens, offsets = [], []
    for record in records:
        offsets.append(text_offset)
        tokens.append(token_text(tokenizer, record.token))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if record.logprob is None else record.logprob.logprob for record in records
        ],
        "top_logprobs": [
            None
            if record.logprob is None
            else {token_text(tokenizer, token): value for token, value in record.logprob.top}
            for record in records
        ],
        "text_offset": offsets,
        "origins": [record.origin for record in records],
    }


def token_text(tokenizer, token: int) -> str:
    """The text of one token as the answer shows it (special tokens included)."""
    return tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def completion_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (of choice ``index``)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` (of choice ``index``)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def infill_body(
    *,
    content: str,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str,
    stats: RequestStats,
    speculative_: dict[str, Any],
) -> dict[str, Any]:
    """The answer of ``/infill`` as llama-server gives it: the text (``content``), ``stop``
    (the answer is whole), the tokens read and written, and ``timings`` in milliseconds;
    ``finish_reason`` as OpenAI's, and flyspec's ``speculative``."""
    prompt_ms = 1000 * stats.prefill_seconds
    predicted_ms = 1000 * max(stats.seconds - stats.prefill_seconds, 0.0)
    return {
        "content": content,
        "stop": True,
        "model": model,
        "tokens_evaluated": prompt_tokens,
        "tokens_predicted": completion_tokens,
        "tokens_cached": stats.cached_prompt_tokens,
        "finish_reason": finish_reason,
        "timings": {
            "cache_n": stats.cached_prompt_tokens,
            "prompt_n": prompt_tokens - stats.cached_prompt_tokens,
            "prompt_ms": round(prompt_ms, 3),
            "predicted_n": completion_tokens,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(1000 * completion_tokens / predicted_ms, 3)
            if predicted_ms > 0
            else None,
        },
        "speculative": speculative_,
    }


def only_fields(result: dict[str, Any], fields: Sequence[str] | None) -> dict[str, Any]:
    """``result`` cut to ``fields`` as llama-server's ``response_fields`` asks: each field a
    path (``timings/prompt_n``) and a key of the answer as written; a path that names nothing
    is left out. None: the whole result."""
    if fields is None:
        return result
    picked: dict[str, Any] = {}
    for path in fields:
        value: Any = result
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[path] = value
    return picked
