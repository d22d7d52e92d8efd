"""One generation request, from its raw body to its response: preparation (parsing,
validation, chat template, tokenizing) on a thread of its own, the job on the engine's queue,
and the answer as one JSON body or as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from flyspec.config import MAX_SEED, DecodeConfig
from flyspec.decoding.grammar import Grammar
from flyspec.errors import FlyspecError
from flyspec.server import protocol, responses
from flyspec.server.errors import (
    describe_validation_errors,
    generation_failed,
    shutting_down,
    unknown_model,
)
from flyspec.server.protocol import (
    CLIENT_CLOSED,
    MESSAGE_LIMIT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    InfillRequest,
    clip,
)
from flyspec.server.requests import request_config
from flyspec.server.scheduler import GenerationQueue, Job, Piece, QueueFullError, TokenRecord
from flyspec.server.tools import (
    CallStream,
    call_grammar,
    check_rendered,
    chosen_name,
    split_calls,
    template_tools,
)


@dataclass(frozen=True)
class Prepared:
    """A checked request: its model, prompt token ids and decoding settings, the token ids
    of its prediction (Predicted Outputs) when it sent one, and the grammar its answer
    follows when it asked for JSON (``response_format``)."""

    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    config: DecodeConfig
    prediction_ids: list[int] | None = None
    grammar: Grammar | None = None

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is read for tool calls."""
        return isinstance(self.body, ChatCompletionRequest) and self.body.calls_tools

    @property
    def tool_names(self) -> frozenset[str]:
        """The names of the functions the request offers (none without tools)."""
        tools = getattr(self.body, "tools", None) or ()
        return frozenset(tool["function"]["name"] for tool in tools)


class GenerationHandler:
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
        """Start the preparation thread (from the app's lifespan), and read the tokenizer for
        the grammar engine there first (seconds for a large vocabulary), so that the first
        request with a schema or tools does not wait for it."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyspec-prepare")
        if hasattr(self.engine, "grammar_tokenizer"):
            self._executor.submit(lambda: self.engine.grammar_tokenizer)

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
        configs = choice_configs(prepared.config, prepared.body.n or 1)
        response_id = responses.new_id("chatcmpl" if chat else "cmpl")
        created = responses.now()
        if prepared.body.stream:
            running = [self._submit(prepared, configs[0])]
            events = self._stream(prepared, configs, running, response_id, created, chat=chat)
            return JobStreamingResponse(events, on_close=lambda: self.queue.cancel(running[-1]))
        answers: list[tuple[Job, Piece]] = []
        for config in configs:  # one choice after another
            job = self._submit(prepared, config)
            answer = await self._answer(request, job)
            if answer is None:
                return Response(status_code=CLIENT_CLOSED)
            answers.append((job, answer))
        choices = [
            self._choice(prepared, job, answer, index=index, chat=chat)
            for index, (job, answer) in enumerate(answers)
        ]
        if len(answers) > 1:  # each choice says how it was decoded
            for choice, (job, _) in zip(choices, answers, strict=True):
                choice["speculative"] = self._speculative(job)
        jobs = [job for job, _ in answers]
        return JSONResponse(
            responses.response_body(
                chat=chat,
                request_id=response_id,
                created=created,
                model=self.model_name,
                choices=choices,
                usage_=responses.jobs_usage(jobs),
                speculative_=self._speculative(jobs[0]),
            )
        )

    async def handle_infill(self, request: Request) -> Response:
        """``POST /infill``: llama-server's fill-in-the-middle request, answered in its
        shape (``content``, ``stop``, ``timings``; streamed as events of ``content``)."""
        if self._executor is None:
            raise RuntimeError("the server is not started (run the app with its lifespan)")
        raw = await request.body()
        content_type = request.headers.get("content-type")
        prepare = functools.partial(
            self.prepare, raw, content_type=content_type, chat=False, infill=True
        )
        prepared = await asyncio.get_running_loop().run_in_executor(self._executor, prepare)
        job = self._submit(prepared, prepared.config)
        if prepared.body.stream:
            return JobStreamingResponse(
                self._infill_events(job), on_close=lambda: self.queue.cancel(job)
            )
        answer = await self._answer(request, job)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED)
        result = self._infill_result(job, answer.text)
        return JSONResponse(responses.only_fields(result, prepared.body.response_fields))

    async def _answer(self, request: Request, job: Job) -> Piece | None:
        """A job's whole text and token records, once it has ended (None when the client
        left first; APIError where it failed or the server is stopping)."""
        try:
            answer = await _wait_unless_disconnected(request, job)
        finally:
            self.queue.cancel(job)  # no-op once the job has ended
        if answer is not None and job.outcome == "error":
            raise generation_failed(job)
        if answer is not None and job.outcome == "cancelled":
            raise shutting_down()
        return answer

    async def _infill_events(self, job: Job) -> AsyncIterator[str]:
        """``/infill``'s server-sent events: the text as it comes, then the result."""
        async for piece in job.pieces():
            yield sse({"content": piece.text, "stop": False})
        if job.outcome == "error":
            yield sse(generation_failed(job).body())
        elif job.outcome == "cancelled":
            yield sse(shutting_down().body())
        else:
            yield sse(self._infill_result(job, ""))

    def _infill_result(self, job: Job, text: str) -> dict[str, Any]:
        return responses.infill_body(
            content=text,
            model=self.model_name,
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=job.completion_tokens,
            finish_reason=job.finish_reason or "length",
            stats=job.stats,
            speculative_=self._speculative(job),
        )

    def _choice(
        self, prepared: Prepared, job: Job, answer: Piece, *, index: int, chat: bool
    ) -> dict[str, Any]:
        """One finished choice: its text, or with tools its text and calls."""
        finish_reason = job.finish_reason or "length"
        logprobs = self._logprobs(job, answer.records, chat=chat)
        if not chat:
            text = answer.text  # the echoed prompt, where asked, came first
            return responses.choice_body(
                chat=False, index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
            )
        calls = []
        text: str | None = answer.text
        if prepared.calls_tools:
            text, calls = split_calls(answer.text, prepared.tool_names)
        return responses.choice_body(
            chat=True,
            index=index,
            text=text,
            finish_reason=responses.with_calls(finish_reason, calls),
            logprobs=logprobs,
            tool_calls=[call.as_dict() for call in calls],
        )

    def _submit(self, prepared: Prepared, config: DecodeConfig) -> Job:
        """A job for one choice of a prepared request, in line (APIError 429 when the line
        is full)."""
        try:
            return self.queue.submit(
                prepared.prompt_ids,
                config,
                timeout=self.request_timeout,
                prediction_ids=prepared.prediction_ids,
                logprobs=prepared.body.requested_logprobs,
                grammar=prepared.grammar,
                echo=getattr(prepared.body, "echoed", None),
                prompt_only=getattr(prepared.body, "prompt_only", False),
            )
        except QueueFullError:
            raise APIError(
                429,
                f"the server is busy: {self.queue.waiting} requests are already waiting "
                f"(queue size {self.queue.max_waiting}); retry later",
                type="requests",
                code="rate_limit_exceeded",
            ) from None

    @staticmethod
    def _speculative(job: Job) -> dict[str, Any]:
        return responses.speculative(job.config.mode, job.stats, timed_out=job.timed_out)

    def _logprobs(
        self, job: Job, records: Sequence[TokenRecord], *, chat: bool, text_offset: int = 0
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice or a chunk (None where the request asked for none)."""
        if job.logprobs is None:
            return None
        tokenizer = self.engine.tokenizer
        if chat:
            return responses.chat_logprobs(records, tokenizer)
        return responses.completion_logprobs(records, tokenizer, text_offset=text_offset)

    def prepare(
        self, raw: bytes, *, content_type: str | None, chat: bool, infill: bool = False
    ) -> Prepared:
        """Parse and check a request body and turn it into prompt token ids and decoding
        settings (APIError for anything the client should fix). Runs off the event loop.
        ``infill``: a body of ``/infill`` (llama-server's shape)."""
        model = ChatCompletionRequest if chat else InfillRequest if infill else CompletionRequest
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
            if body.prompt_only:
                max_tokens = 1  # the settings of a request, which decodes nothing
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
        vocab_size = self.engine.vocab_size
        outside = [token for token, _ in config.sampling.logit_bias if token >= vocab_size]
        if outside:
            raise APIError(
                400,
                f"logit_bias: token {outside[0]} is not in the model's vocabulary "
                f"({vocab_size} tokens)",
                param="logit_bias",
            )
        prediction_ids = None
        if body.prediction is not None:
            prediction_ids = self.engine.encode_prediction(body.prediction)
            try:
                self.engine.check_prediction(prompt_ids, prediction_ids)
            except FlyspecError as error:
                raise APIError(
                    400, str(error), param="prediction", code="context_length_exceeded"
                ) from None
        if config.uses_draft_model and not self.engine.has_draft:
            raise APIError(
                400,
                f"mode {config.mode!r} with the {config.drafter!r} drafter needs a draft model, "
                "and this server has none; use mode 'target' or drafter 'ngram'",
                param="drafter",
            )
        return Prepared(
            body=body,
            prompt_ids=prompt_ids,
            config=config,
            prediction_ids=prediction_ids,
            grammar=self._grammar(body),
        )

    def _grammar(self, body: CompletionRequest | ChatCompletionRequest) -> Grammar | None:
        """The grammar of ``response_format``'s JSON, or of the tool calls a ``tool_choice``
        requires (APIError 400 naming the field for one the grammar engine cannot use)."""
        if isinstance(body, ChatCompletionRequest) and body.calls_tools:
            name = chosen_name(body.tool_choice)
            if body.tool_choice != "required" and name is None:
                return None  # auto: the model answers or calls as it likes
            try:
                return call_grammar(
                    body.tools,
                    name=name,
                    parallel=body.parallel_tool_calls is not False,
                    tokenizer=self.engine.grammar_tokenizer,
                )
            except FlyspecError as error:
                raise APIError(400, clip(str(error), MESSAGE_LIMIT), param="tools") from None
        if body.response_format is None:
            return None
        try:
            return self.engine.json_grammar(body.response_format.schema)
        except FlyspecError as error:
            raise APIError(
                400,
                clip(f"response_format: {error}", MESSAGE_LIMIT),
                param="response_format",
                code="invalid_json_schema",
            ) from None

    def _encode(self, body: CompletionRequest | ChatCompletionRequest, *, chat: bool) -> list[int]:
        try:
            if isinstance(body, ChatCompletionRequest):
                if not body.messages:
                    raise APIError(400, "messages must not be empty", param="messages")
                messages = [m.as_template_dict() for m in body.messages]
                if not body.calls_tools:
                    return self.engine.encode_messages(messages)
                tools = template_tools(body.tools)
                problem = check_rendered(
                    self.engine.render_messages(messages, tools=tools),
                    self.engine.render_messages(messages),
                )
                if problem is not None:
                    raise APIError(400, problem, param="tools")
                return self.engine.encode_messages(messages, tools=tools)
            if isinstance(body, InfillRequest):
                return self.engine.encode_infill(
                    body.input_prefix, body.input_suffix, files=body.files, middle=body.prompt
                )
            if body.suffix:
                return self._encode_infill(body.prompt, body.suffix)
            return self.engine.encode(body.prompt)
        except APIError:
            raise
        except FlyspecError as error:
            raise APIError(
                400, clip(str(error), MESSAGE_LIMIT), param=_prompt_param(body)
            ) from None
        except Exception as error:  # a chat template that raises on this conversation
            if chat and type(error).__module__.startswith("jinja2"):
                raise APIError(
                    400,
                    f"the chat template refused these messages: {clip(str(error), MESSAGE_LIMIT)}",
                    param="messages",
                ) from None
            raise

    def _encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """A completion with a ``suffix``: fill-in-the-middle through the model's tokens
        (APIError 400 naming ``suffix`` where the model has none)."""
        try:
            return self.engine.encode_infill(prefix, suffix)
        except FlyspecError as error:
            raise APIError(400, clip(str(error), MESSAGE_LIMIT), param="suffix") from None

    async def _stream(
        self,
        prepared: Prepared,
        configs: list[DecodeConfig],
        running: list[Job],
        response_id: str,
        created: int,
        *,
        chat: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events of each choice in turn (``running`` holds the first's job, and
        gets each later one as it starts); the usage, of them all, with the last."""
        common = {"request_id": response_id, "created": created, "model": self.model_name}
        for index, config in enumerate(configs):
            if index:
                try:
                    running.append(self._submit(prepared, config))
                except APIError as error:
                    yield sse(error.body())
                    break
            job = running[-1]
            if chat:
                delta = {"role": "assistant", "content": ""}
                yield sse(responses.chat_chunk(**common, delta=delta, index=index))
            offset = 0
            calls = CallStream(prepared.tool_names) if prepared.calls_tools else None
            async for piece in job.pieces():
                logprobs = self._logprobs(job, piece.records, chat=chat, text_offset=offset)
                offset += len(piece.text)
                if calls is not None:
                    for delta in responses.call_deltas(*calls.feed(piece.text), calls.calls):
                        yield sse(responses.chat_chunk(**common, delta=delta, index=index))
                    if logprobs is not None:  # a chunk of its own: the text may be held
                        delta = {"content": ""}
                        chunk = responses.chat_chunk(
                            **common, delta=delta, logprobs=logprobs, index=index
                        )
                        yield sse(chunk)
                    continue
                if chat:
                    delta = {"content": piece.text}
                    chunk = responses.chat_chunk(
                        **common, delta=delta, logprobs=logprobs, index=index
                    )
                else:
                    chunk = responses.completion_chunk(
                        **common, text=piece.text, logprobs=logprobs, index=index
                    )
                yield sse(chunk)
            if job.outcome == "error":
                yield sse(generation_failed(job).body())
                break
            if job.outcome == "cancelled":
                yield sse(shutting_down().body())
                break
            finish_reason = job.finish_reason or "length"
            if calls is not None:
                for delta in responses.call_deltas(*calls.finish(), calls.calls):
                    yield sse(responses.chat_chunk(**common, delta=delta, index=index))
                finish_reason = responses.with_calls(finish_reason, calls.calls)
            if chat:
                final = responses.chat_chunk(
                    **common, delta={}, finish_reason=finish_reason, index=index
                )
            else:
                final = responses.completion_chunk(
                    **common, text="", finish_reason=finish_reason, index=index
                )
            if index == len(configs) - 1:
                final["usage"] = responses.jobs_usage(running)
            final["speculative"] = self._speculative(job)
            yield sse(final)
        yield "data: [DONE]\n\n"


def _prompt_param(body: CompletionRequest | ChatCompletionRequest) -> str:
    """The field that holds a request's prompt."""
    if isinstance(body, ChatCompletionRequest):
        return "messages"
    return "input_prefix" if isinstance(body, InfillRequest) else "prompt"


def choice_configs(config: DecodeConfig, n: int) -> list[DecodeConfig]:
    """The settings of each of a request's ``n`` choices: its own, with the seed moved on by
    the choice's index where one is set (the choices of a sampled request differ, and are
    reproducible)."""
    seed = config.sampling.seed
    if n == 1 or seed is None:
        return [config] * n
    return [
        config.with_updates(sampling=replace(config.sampling, seed=(seed + i) % (MAX_SEED + 1)))
        for i in range(n)
    ]


class JobStreamingResponse(StreamingResponse):
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


async def _wait_unless_disconnected(request: Request, job: Job) -> Piece | None:
    """The job's text and token records, or None when the client disconnected first."""
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


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"
