"""The OpenAI-compatible wire format: request models, the error body, paths and limits.

Requests are validated strictly (a number sent as a string is an error, as with OpenAI) and
unknown fields are refused, so a misspelt setting is reported instead of silently ignored.
Standard OpenAI fields the server does not implement are accepted only at their neutral value
(``n: 1``, ``logprobs: null`` ...), and refused otherwise; platform options with nothing to do
here (``metadata``, ``service_tier``, ``store: false`` ...) are checked and accepted
(docs/server.md, "What a request may send").

``prediction`` (Predicted Outputs) is OpenAI's ``{"type": "content", "content": ...}``, the
content a string or a list of text parts; it is read as its text. ``loosen_predicted``
(extension) lets FLy's rule apply to the tokens drafted from it.

FLy settings ride as extra top-level fields: ``mode``, ``drafter``, ``k`` (an integer, or
``"auto"``: :func:`flyspec.server.requests.request_config` says how it meets the server's
``-k``), ``window``,
``theta`` (a number, or the string ``"inf"`` to switch loosening off), ``entropy``, the rules
beyond the paper ``min_ratio``, ``max_rank``, ``max_draft_confidence`` and ``defer``, plus
``top_k``. Their ranges are
checked by :mod:`flyspec.config`, not here.

:func:`parse_request` turns a raw body into a request model: it checks the media type, UTF-8,
JSON syntax and nesting, the number of chat messages and that every string is valid Unicode
before pydantic sees the data, so each of those problems gets its own message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flyspec.server.tools import NAME, check_tool_choice, check_tools, chosen_name

FinishReason = Literal["stop", "length", "tool_calls"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
INFILL = "/infill"  # llama-server's fill-in-the-middle route
GENERATION_ENDPOINTS = (COMPLETIONS, CHAT, INFILL)
ENDPOINTS = (COMPLETIONS, CHAT, INFILL, "/v1/models", "/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer

MAX_CHOICES = 16
"""The most choices (``n``) a request may ask for: they are decoded one after another."""
CHAT_TOP_LOGPROBS = 20  # OpenAI's limits on the alternatives of a token's logprobs
COMPLETION_LOGPROBS = 5
METADATA_PAIRS = 16  # OpenAI's limits on ``metadata``
METADATA_KEY_LIMIT = 64
METADATA_VALUE_LIMIT = 512
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
"""OpenAI's service tiers: each is accepted and served as ``default``, the only one here."""
NOT_YET = (
    "functions",
    "function_call",
    "audio",
    "web_search_options",
    "reasoning_effort",
    "verbosity",
)
"""Chat fields refused with 400 whatever their value (docs/server.md)."""
ECHO_LIMIT = 100  # characters of a client's value repeated in an error message
MESSAGE_LIMIT = 300  # characters of an error message built around a client's value


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
    """OpenAI's error object. Lone surrogates are escaped, so the body always encodes."""
    return {
        "error": {
            "message": printable(message),
            "type": type,
            "param": None if param is None else printable(param),
            "code": code,
        }
    }


def printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes (UTF-8 encodable)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` cut to ``limit`` characters plus ``...`` and its length, when longer."""
    text = printable(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quote(value: str, limit: int = ECHO_LIMIT) -> str:
    """A client's string for an error message: quoted like ``repr`` and clipped."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def invalid_text(data: Any) -> tuple[str | None, str] | None:
    """``(param, message)`` for the first string (or object key) in parsed JSON that holds a
    lone surrogate: JSON lets ``"\\ud800"`` through, but it is not Unicode text and the
    tokenizer cannot take it. ``param`` is the dotted path (``messages.0.content``).

    Iterative, so arbitrarily deep data cannot overflow the stack.
    """
    pending: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while pending:
        value, path = pending.pop()
        param = ".".join(path) or None
        if isinstance(value, str):
            at = _surrogate_at(value)
            if at is not None:
                what = param or "the request body"
                return param, f"{what} is not valid Unicode text: {_surrogate_note(value, at)}"
        elif isinstance(value, dict):
            children = []
            for key, child in value.items():
                at = _surrogate_at(key)
                if at is not None:
                    where = f"a key of {param}" if param else "a field name"
                    return param, f"{where} is not valid Unicode text: {_surrogate_note(key, at)}"
                children.append((child, (*path, clip(key))))
            pending.extend(reversed(children))
        elif isinstance(value, list):
            pending.extend(
                (child, (*path, str(i))) for i, child in reversed(list(enumerate(value)))
            )
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def _surrogate_note(text: str, at: int) -> str:
    return (
        f"a lone surrogate \\u{ord(text[at]):04x} at character {at} "
        "(\\ud800-\\udfff escapes are only valid as a high-low pair)"
    )


RequestModel = TypeVar("RequestModel", bound=BaseModel)


def parse_request(
    raw: bytes, *, content_type: str | None, model: type[RequestModel], max_messages: int | None
) -> RequestModel:
    """A request model from a raw body: APIError 400 for a body that is not a UTF-8 JSON
    document sent as ``application/json``, nested too deep, with more than ``max_messages``
    chat messages or with invalid text; pydantic's ValidationError for the fields."""
    if not raw:
        raise APIError(400, "a JSON body is required", code="missing_required_parameter")
    if not _is_json_media_type(content_type):
        raise APIError(
            400,
            "the request body must be a JSON object sent with Content-Type: application/json"
            f" (got {quote(content_type) if content_type else 'no Content-Type'})",
            code="invalid_type",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(
            400,
            f"the request body is not valid UTF-8: byte 0x{raw[error.start]:02x} at offset "
            f"{error.start}",
            code="invalid_json",
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise APIError(
            400,
            f"the request body is not valid JSON ({error.msg} at character {error.pos})",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise APIError(
            400,
            "the request body is nested too deep: its JSON arrays and objects go deeper than "
            "the parser's limit (about a thousand levels)",
            code="invalid_json",
        ) from None
    if isinstance(data, dict) and max_messages is not None:
        messages = data.get("messages")
        if isinstance(messages, list) and len(messages) > max_messages:
            raise APIError(
                400,
                f"too many messages: {len(messages)}, and this server takes at most "
                f"{max_messages} (flyspec serve --max-messages)",
                param="messages",
                code="array_above_max_length",
            )
    found = invalid_text(data)
    if found is not None:
        param, message = found
        raise APIError(400, message, param=param, code="invalid_text")
    return model.model_validate(data)


def _is_json_media_type(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def text_of_parts(value: Any, *, what: str) -> str:
    """The text of a string or of a list of text parts ``{"type": "text", "text": ...}``
    (a message's content, a prediction's); ValueError naming ``what`` otherwise."""
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
                raise ValueError(f'{what} parts must be {{"type": "text", "text": "..."}}')
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{what} must be a string or a list of text parts")


@dataclass(frozen=True)
class ResponseFormat:
    """``response_format`` asking for JSON: the answer is a value ``schema`` allows (None:
    any JSON object, ``json_object``), named ``name`` (``json_schema``'s)."""

    schema: dict[str, Any] | None
    name: str | None = None


def response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's ``response_format``, checked (ValueError naming what is wrong): ``text`` is
    None, ``json_object`` and ``json_schema`` a :class:`ResponseFormat`. ``strict`` is
    accepted either way: the grammar holds the answer to the schema in both."""
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise ValueError(
            'response_format must be {"type": ...} with the type "text", "json_object" or '
            '"json_schema"'
        )
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(
            f"response_format of type {kind!r} has unknown field(s): {', '.join(unknown)}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(schema=None)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('response_format of type "json_schema" needs a json_schema object')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"response_format.json_schema has unknown field(s): {', '.join(unknown)}")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError("response_format.json_schema.name must be 1 to 64 letters, digits, _ or -")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON object (a schema)")
    if not isinstance(spec.get("strict", False), bool | None):
        raise ValueError("response_format.json_schema.strict must be true or false")
    if not isinstance(spec.get("description", ""), str):
        raise ValueError("response_format.json_schema.description must be a string")
    return ResponseFormat(schema=schema, name=name)


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
    logit_bias: dict[str, int | float] | None = None
    repetition_penalty: float | None = None  # extension, as vLLM's
    stream_options: dict[str, Any] | None = None
    prediction: Any = None
    response_format: Any = None
    # Accepted, with no effect on the answer: identifiers and options of OpenAI's platform.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # FLy settings and top-k (extensions)
    mode: str | None = None
    drafter: str | None = None
    k: int | Literal["auto"] | None = None
    window: int | None = None
    theta: float | None = None
    entropy: str | None = None
    min_ratio: float | None = None
    max_rank: int | None = None
    max_draft_confidence: float | None = None
    defer: bool | None = None
    loosen_predicted: bool | None = None
    top_k: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {METADATA_PAIRS} pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > METADATA_KEY_LIMIT or len(text) > METADATA_VALUE_LIMIT:
                raise ValueError(
                    f"metadata keys hold at most {METADATA_KEY_LIMIT} characters and values "
                    f"{METADATA_VALUE_LIMIT}: {quote(key)} is too long"
                )
        return value

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, value: str | None) -> str | None:
        if value is not None and value not in SERVICE_TIERS:
            raise ValueError(
                f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {quote(value)}"
            )
        return value

    @field_validator("prediction")
    @classmethod
    def _prediction(cls, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
            raise ValueError(
                'prediction must be an object {"type": "content", "content": ...} '
                "(Predicted Outputs)"
            )
        unknown = sorted(set(value) - {"type", "content"})
        if unknown:
            raise ValueError(f"prediction has unknown field(s): {', '.join(unknown)}")
        text = text_of_parts(value["content"], what="prediction.content")
        if not text:
            raise ValueError("prediction.content is empty: send the text the answer should repeat")
        return text

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any) -> ResponseFormat | None:
        return None if value is None else response_format(value)

    @field_validator("k", mode="before")
    @classmethod
    def _k(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            raise ValueError(f'k must be an integer >= 1 or "auto", got {quote(value)}')
        return value

    @field_validator("theta", mode="before")
    @classmethod
    def _theta(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("inf", "infinity", "+inf"):
            return math.inf
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first standard field set to something not implemented."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n must be in [1, {MAX_CHOICES}] (the choices are decoded one by one)"
        if self.store:
            return "store", "store: this server keeps no completions (send false or leave it out)"
        return None

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs (ValueError for a key that is not a
        token id)."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {quote(key)}")
            pairs.append((int(key), float(value)))
        return tuple(pairs)

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

    @property
    def echoed(self) -> str | None:
        """The text that comes before each choice's answer: the prompt with ``echo``."""
        return self.prompt if self.echo else None

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (and its log-probabilities) alone, as
        evaluation harnesses ask for a text's likelihood."""
        return bool(self.echo) and self.max_tokens == 0

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found:
            return found
        if self.echo and self.suffix:
            return "echo", "echo with a suffix is not supported (send one or the other)"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 asks for the prompt alone: send it with echo"
        if self.logprobs is not None and not 0 <= self.logprobs <= COMPLETION_LOGPROBS:
            return "logprobs", f"logprobs must be in [0, {COMPLETION_LOGPROBS}] (the alternatives)"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of = 1 is supported"
        return None

    @property
    def requested_logprobs(self) -> int | None:
        """The alternatives each token's log-probability comes with (None: no
        log-probabilities)."""
        return self.logprobs


class InfillFile(BaseModel):
    """One file of ``/infill``'s ``input_extra``: other code of the project."""

    model_config = ConfigDict(extra="forbid", strict=True)

    filename: str = "file"
    text: str = ""
    time: float | None = None  # when the editor read it (llama.vim sends it): not used


class InfillRequest(CompletionRequest):
    """``POST /infill``, llama-server's fill-in-the-middle request: the text before the
    gap (``input_prefix``), after it (``input_suffix``), other files of the project
    (``input_extra``) and the start of the middle (``prompt``), as editor plugins for
    llama.cpp send them. It takes the fields of ``/v1/completions`` too, and llama.cpp's
    ``n_predict`` (at most that many tokens; negative: no limit but the server's) for
    ``max_tokens``, and ``response_fields`` (the answer's fields to give, ``timings/prompt_n``
    naming a nested one). llama.cpp's settings of its own server (``cache_prompt``,
    ``samplers``, ``t_max_prompt_ms``, ``t_max_predict_ms``, ``n_indent``, ``id_slot``) are
    accepted and have no effect: flyspec keeps its prompt cache always and samples in one
    order."""

    prompt: Any = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillFile] = Field(default_factory=list)
    n_predict: int | None = None
    cache_prompt: bool | None = None
    samplers: list[str] | str | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    response_fields: list[str] | None = None
    n_indent: int | None = None
    id_slot: int | None = None

    @model_validator(mode="after")
    def _n_predict(self) -> InfillRequest:
        if self.n_predict is not None and self.n_predict >= 0 and self.max_tokens is None:
            self.max_tokens = self.n_predict
        return self

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found:
            return found
        if self.suffix is not None:
            return "suffix", "/infill takes the text after the gap as input_suffix"
        if self.echo:
            return "echo", "echo is not supported on /infill"
        if self.n not in (None, 1):
            return "n", "/infill answers with one completion: leave out n"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported on /infill: use /v1/completions"
        return None

    @property
    def files(self) -> list[tuple[str, str]]:
        """``input_extra`` as ``(name, text)`` pairs."""
        return [(file.filename, file.text) for file in self.input_extra]


class ChatMessage(BaseModel):
    """One message of a conversation; ``content`` may also be a list of text parts. An
    assistant's message may carry the ``tool_calls`` it made (its content then optional), a
    ``tool`` message the answer to one of them (``tool_call_id``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Any
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _calls_alone(cls, data: Any) -> Any:
        """An assistant's message of tool calls may leave its content out."""
        if isinstance(data, dict) and "content" not in data and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return None if value is None else text_of_parts(value, what="content")

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for call in value or ():
            function = call.get("function") if isinstance(call, dict) else None
            if (
                call.get("type", "function") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)
            ):
                raise ValueError(
                    'tool_calls entries must be {"id": ..., "type": "function", "function": '
                    '{"name": ..., "arguments": "<JSON text>"}}'
                )
        return value

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (``developer`` becomes ``system``; a tool
        call's arguments a JSON object, where they parse as one)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": _arguments(call["function"]["arguments"]),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message


def _arguments(text: str) -> Any:
    """A call's arguments as the template writes them: the JSON object they encode, else
    the text as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool | None = None
    tools: Any = None
    tool_choice: Any = None
    # Refused unless left out (docs/server.md, "What a request may send").
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: Any) -> list[dict[str, Any]] | None:
        return None if value is None else check_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | dict[str, Any] | None:
        return None if value is None else check_tool_choice(value)

    @property
    def calls_tools(self) -> bool:
        """Whether the model is shown tools and its answer read for calls (``tools`` sent,
        ``tool_choice`` not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def requested_logprobs(self) -> int | None:
        """The alternatives each token's log-probability comes with (None: no
        log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found:
            return found
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= CHAT_TOP_LOGPROBS:
                return "top_logprobs", f"top_logprobs must be in [0, {CHAT_TOP_LOGPROBS}]"
            if self.top_logprobs and not self.logprobs:
                return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", 'modalities: this server answers in text only (send ["text"])'
        for name in NOT_YET:
            if getattr(self, name) is not None:
                return name, f"{name} is not supported"
        if self.tool_choice is not None and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        named = chosen_name(self.tool_choice)
        if named is not None and named not in {t["function"]["name"] for t in self.tools}:
            return "tool_choice", f"tool_choice names {quote(named)}, which is none of the tools"
        if self.response_format is not None and self.calls_tools:
            return (
                "response_format",
                "send response_format or tools, not both (or tool_choice none): one grammar "
                "holds an answer",
            )
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
        return None
