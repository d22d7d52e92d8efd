"""Tool calls (OpenAI's ``tools``): the functions go to the model through its own chat
template, and what it writes back in the template's tool-call format becomes
``message.tool_calls``.

The format read here is the one of Qwen2.5's template (Hermes's): each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` lines. A
template that does not describe the tools, or describes them in another format, is refused
when a request sends tools (:func:`check_rendered`).

``tool_choice``: ``auto`` lets the model answer in text or call tools, parsed from what it
wrote; ``none`` shows it no tools; ``required`` and a named function are held to a grammar
(:func:`call_grammar`): the answer is one call (or several, with ``parallel_tool_calls``)
whose ``name`` is a tool's and whose ``arguments`` follow that tool's ``parameters``, verified
under the grammar's mask as any structured output (:mod:`flyspec.decoding.grammar`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from flyspec.decoding.grammar import (
    Grammar,
    GrammarTokenizer,
    lark_grammar,
    lark_json,
    lark_literal,
)
from flyspec.engine import held_back

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a name: a function's, a ``json_schema``'s."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's ``name`` and its ``arguments`` as a JSON
    text (OpenAI's form), with the ``id`` the client answers it by."""

    name: str
    arguments: str
    id: str

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (streamed: with its ``index``)."""
        entry: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return entry if index is None else {"index": index, **entry}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def check_tools(value: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools``, checked (ValueError naming what is wrong): a list of
    ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``
    with distinct names."""
    if not isinstance(value, list) or not value:
        raise ValueError("tools must be a non-empty list of functions")
    names = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ValueError(f"{where} has unknown field(s): {', '.join(unknown)}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ValueError(f"{where}.function has unknown field(s): {', '.join(unknown)}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema (an object)")
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.function.description must be a string")
    return value


def check_tool_choice(value: Any) -> str | dict[str, Any]:
    """OpenAI's ``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function",
    "function": {"name": ...}}`` (ValueError otherwise)."""
    if value in ("none", "auto", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
        and set(value) == {"type", "function"}
    ):
        return value
    raise ValueError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        '{"name": ...}}'
    )


def chosen_name(tool_choice: str | dict[str, Any] | None) -> str | None:
    """The function a named ``tool_choice`` asks for (None for the others)."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def check_rendered(with_tools: str, without_tools: str) -> str | None:
    """Why a conversation the chat template rendered ``with_tools`` (and ``without_tools``)
    cannot be served with tool calls (None when it can): the template left the tools out, or
    describes calls in another format than :data:`OPEN` ... :data:`CLOSE`."""
    if with_tools == without_tools:
        return "this model's chat template has no tool format (it leaves the tools out)"
    if OPEN not in with_tools.replace(without_tools, ""):
        return (
            "this model's chat template describes tool calls in a format flyspec does not "
            f"read yet (it reads {OPEN} ... {CLOSE}, as Qwen2.5's and Hermes's templates)"
        )
    return None


def template_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (OpenAI's form, ``strict`` left out)."""
    return [
        {
            "type": "function",
            "function": {k: v for k, v in tool["function"].items() if k != "strict"},
        }
        for tool in tools
    ]


def call_grammar(
    tools: Sequence[dict[str, Any]],
    *,
    name: str | None,
    parallel: bool,
    tokenizer: GrammarTokenizer,
) -> Grammar:
    """The grammar of an answer that is tool calls and nothing else: one call of function
    ``name`` (a named ``tool_choice``), or one call of any tool, or several with
    ``parallel`` (``required``); each call's arguments follow its function's
    ``parameters``."""
    functions = [
        tool["function"] for tool in tools if name is None or tool["function"]["name"] == name
    ]
    bodies = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    opening, closing = lark_literal(OPEN, tokenizer), lark_literal(CLOSE, tokenizer)
    source = "\n".join(
        [
            f"start: call{repeat}",
            f'call: {opening} "\\n" body "\\n" {closing}',
            f"body: {lark_json(body)}",
        ]
    )
    return lark_grammar(source, tokenizer, description="the tools' parameters")


_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def parse_call(body: str) -> ToolCall | None:
    """A call from the JSON between the tags (None where it is no call: not JSON, no name)."""
    return _call_of(_json_or_none(body))


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_of(value: Any) -> ToolCall | None:
    """The call a parsed JSON value names (None where it is no object with a ``name``)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name=value["name"], arguments=arguments, id=new_call_id())


_FENCE = re.compile(r"\A\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*\Z", re.DOTALL)


def bare_call(text: str, names: Collection[str]) -> ToolCall | None:
    """The answer as a call written without the tags: a JSON object (alone, or in a code
    fence) with the ``name`` of one of the tools and its ``arguments``, as small models
    write in ``auto`` (seen: Qwen2.5-Coder-1.5B). None for any other answer."""
    match = _FENCE.match(text)
    value = None if match is None else _json_or_none(match.group(1))
    if (
        not isinstance(value, dict)
        or set(value) != {"name", "arguments"}
        or not isinstance(value["name"], str)
        or value["name"] not in names
        or not isinstance(value["arguments"], dict)
    ):
        return None
    return _call_of(value)


def split_calls(text: str, names: Collection[str] = ()) -> tuple[str | None, list[ToolCall]]:
    """An answer's text before its calls, and the calls (each between :data:`OPEN` and
    :data:`CLOSE`; the last may lack its closing tag; or the whole answer a call of one of
    ``names`` without the tags, :func:`bare_call`). A block that holds no call stays in the
    text; without calls the text is the whole answer."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _CALL.finditer(text):
        call = parse_call(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        call = bare_call(text, names)
        return (None, [call]) if call is not None else (text, [])
    kept.append(text[position:])
    content = "".join(kept).strip()
    return content or None, calls


class CallStream:
    """Splits a streamed answer into text and tool calls as it arrives: text is released up
    to where a call might begin (a prefix of :data:`OPEN` is held back), a call once its
    closing tag (or the answer's end) has come. An answer that begins as JSON or a code
    fence is held to its end, where it may be a call without the tags (:func:`bare_call`
    of one of ``names``)."""

    def __init__(self, names: Collection[str] = ()) -> None:
        self._buffer = ""
        self._names = names
        self._holding: str | None = None  # an answer held whole, while it may be a bare call
        self._started = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text released and the calls completed by ``text``."""
        if not self._started:
            self._holding = (self._holding or "") + text
            if self._may_be_bare(self._holding):
                return "", []
            text, self._holding, self._started = self._holding, None, True
        self._buffer += text
        released: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = held_back(self._buffer, (OPEN,))
                released.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            end = self._buffer.find(CLOSE, start)
            if end < 0:
                released.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            call = parse_call(self._buffer[start + len(OPEN) : end].strip())
            block_end = end + len(CLOSE)
            if call is None:  # no call: the block is text
                released.append(self._buffer[:block_end])
            else:
                released.append(self._buffer[:start])
                calls.append(call)
            self._buffer = self._buffer[block_end:]
        self.calls += calls
        return _strip_between("".join(released), bool(self.calls)), calls

    def _may_be_bare(self, held: str) -> bool:
        """Whether an answer that begins with ``held`` may still be a call without tags."""
        opening = held.lstrip()
        if not self._names:
            return False
        return not opening or opening.startswith(("{", "```")) or "```".startswith(opening)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the answer's end: a call that lacks its closing tag, or text."""
        if not self._started and self._holding is not None:
            held, self._holding, self._started = self._holding, None, True
            call = bare_call(held, self._names)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            released, calls = self.feed(held)
            rest, more = self.finish()
            return released + rest, calls + more
        rest, self._buffer = self._buffer, ""
        if rest.startswith(OPEN):
            call = parse_call(rest[len(OPEN) :].strip())
            if call is not None:
                self.calls.append(call)
                return "", [call]
        return _strip_between(rest, bool(self.calls)), []


def _strip_between(text: str, after_a_call: bool) -> str:
    """The line breaks between calls are no text of the answer."""
    return text.strip() if after_a_call and not text.strip() else text
