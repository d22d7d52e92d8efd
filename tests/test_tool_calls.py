"""Tool calls through `flyspec serve` with the official openai client, on tiny random-weight
models whose chat template has Qwen2.5's tool format (tests/tiny.py): ``tool_choice``
``required`` and a named function held to the tools' parameters by the grammar, under exact
and FLy verification, streamed and not; a call's answer fed back through the template; and the
parsing of what a model writes, piece by piece as it streams."""

from __future__ import annotations

import json

import openai
import pytest

from flyspec.config import DecodeConfig
from flyspec.decoding.grammar import GrammarTokenizer
from flyspec.engine import Engine
from flyspec.server.app import create_app
from flyspec.server.tools import CallStream, call_grammar, split_calls
from tests.test_server import MODEL, VOCAB, loosening_engine, openai_client, running
from tests.tiny import make_tiny_tokenizer

BUDGET = 600
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "the forecast", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {
            "name": "time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "the weather in paris"}]


def valid_call(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "weather":
        return arguments["city"] in ("paris", "rome") and arguments["days"] in (1, 2, 3)
    return call.function.name == "time" and arguments == {"zone": arguments["zone"]}


def test_calls_are_split_from_the_text_the_model_wrote():
    text = (
        'Let me look.<tool_call>\n{"name": "weather", "arguments": {"city": "rome"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}'
    )
    content, calls = split_calls(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "rome"}),
        ("time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    # No call: the text as it is; a block that is no call stays in the text.
    assert split_calls("plain") == ("plain", [])
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert split_calls(broken) == (broken, [])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_stream_splits_as_the_whole_text_does(step):
    text = (
        'Sure <tool_c and more.<tool_call>\n{"name": "weather", "arguments": {"city": "rome"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"zone": "utc"}}'
    )
    stream = CallStream()
    released, calls = [], []
    for start in range(0, len(text), step):
        piece, new = stream.feed(text[start : start + step])
        released.append(piece)
        calls += new
    piece, new = stream.finish()
    released.append(piece)
    calls += new
    content, expected = split_calls(text)
    assert "".join(released).strip() == content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]


def test_the_grammar_holds_a_call_to_the_tools_parameters():
    tokenizer = make_tiny_tokenizer(VOCAB)
    grammar_tokenizer = GrammarTokenizer(
        tokenizer, vocab_size=VOCAB, eos_token_ids=[tokenizer.eos_token_id]
    )
    import llguidance

    def accepts(grammar, text: str) -> bool:
        matcher = llguidance.LLMatcher(
            grammar.tokenizer.engine_tokenizer, grammar.source, log_level=0
        )
        ids = tokenizer.encode(text)
        return (
            matcher.validate_tokens(ids) == len(ids)
            and matcher.consume_tokens(ids)
            and (matcher.is_accepting())
        )

    call = (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>'
    )
    other = '<tool_call>\n{"name": "time", "arguments": {"zone": "utc"}}\n</tool_call>'
    required = call_grammar(TOOLS, name=None, parallel=True, tokenizer=grammar_tokenizer)
    assert accepts(required, call) and accepts(required, other)
    assert accepts(required, call + "\n" + other)
    assert not accepts(required, call.replace("rome", "oslo"))
    assert not accepts(required, "hello")
    single = call_grammar(TOOLS, name=None, parallel=False, tokenizer=grammar_tokenizer)
    assert accepts(single, call) and not accepts(single, call + "\n" + other)
    named = call_grammar(TOOLS, name="time", parallel=True, tokenizer=grammar_tokenizer)
    assert accepts(named, other) and not accepts(named, call)


MODES = {
    "target": {"mode": "target"},
    "spd": {"mode": "spd"},
    "fly": {"mode": "fly", "theta": 0.0, "window": 0},
    "sampled": {"mode": "spd", "temperature": 1.0, "seed": 4},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("choice", ["required", "weather"])
def test_a_required_call_is_well_formed(loose_client, mode, choice):
    tool_choice = (
        choice
        if choice == "required"
        else {
            "type": "function",
            "function": {"name": choice},
        }
    )
    completion = loose_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        extra_body=MODES[mode],
    )
    choice_ = completion.choices[0]
    assert choice_.finish_reason == "tool_calls"
    (call,) = choice_.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert valid_call(call)
    if choice == "weather":
        assert call.function.name == "weather"
    assert not choice_.message.content


def test_a_streamed_call_arrives_as_openai_streams_it(loose_client):
    stream = loose_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "time"}},
        stream=True,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for delta in deltas for call in delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0
    assert calls[0].function.name == "time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_call_round_trips(loose_client):
    first = loose_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 18 degrees"},
    ]
    answer = loose_client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call and its answer went into the prompt.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + len("sunny, 18 degrees")


def test_auto_and_none_answer_in_text_or_calls(loose_client):
    for tool_choice in ("auto", "none"):
        completion = loose_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=12
        )
        choice = completion.choices[0]
        if choice.message.tool_calls:
            assert tool_choice == "auto" and choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content is not None


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "twice"),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}},
            "response_format",
            "not both",
        ),
    ],
)
def test_tools_that_cannot_be_used_are_a_400_naming_the_field(loose_client, body, param, named):
    with pytest.raises(openai.BadRequestError) as raised:
        loose_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **body)
    error = raised.value.body
    assert error["param"] == param and named in error["message"], error


def test_a_template_without_a_tool_format_is_refused():
    tokenizer = make_tiny_tokenizer(VOCAB)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
    engine = Engine(target_model=loosening_engine().target_model, tokenizer=tokenizer)
    app = create_app(
        engine, defaults=DecodeConfig(mode="target", max_new_tokens=4), model_name=MODEL
    )
    with running(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        assert raised.value.body["param"] == "tools"
        assert "no tool format" in raised.value.body["message"]
        # tool_choice none shows the model no tools: answered.
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none"
        )


def test_the_llamacpp_backend_calls_tools(tiny_llamacpp_engine):
    pytest.importorskip("llama_cpp")
    with openai_client(tiny_llamacpp_engine, max_new_tokens=BUDGET) as client:
        for extra in ({"mode": "target"}, {"mode": "fly", "theta": 0.0, "window": 0}):
            completion = client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=TOOLS[1:],  # the shortest: the tiny GGUF's context is 512 tokens
                tool_choice="required",
                parallel_tool_calls=False,
                extra_body=extra,
            )
            (call,) = completion.choices[0].message.tool_calls
            assert valid_call(call)


def test_a_call_written_without_the_tags_is_read_as_a_call():
    """Small models in auto write the call as a JSON object, often in a code fence."""
    names = {"weather", "time"}
    fenced = '```json\n{\n  "name": "weather",\n  "arguments": {"city": "rome"}\n}\n```'
    for text in (fenced, '{"name": "time", "arguments": {}}'):
        content, calls = split_calls(text, names)
        assert content is None and len(calls) == 1
        for step in (1, 5, 1000):
            stream = CallStream(names)
            pieces = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
            pieces.append(stream.finish())
            assert "".join(piece for piece, _ in pieces) == ""
            assert [c.name for _, new in pieces for c in new] == [calls[0].name]
    # Not one of the tools, or more than a call: the text as it is.
    for text in ('{"name": "other", "arguments": {}}', '{"name": "time", "arguments": {}, "x": 1}'):
        assert split_calls(text, names) == (text, [])
        stream = CallStream(names)
        released, calls = stream.feed(text)
        rest, more = stream.finish()
        assert released + rest == text and not calls + more
    # Without tool names (tool_choice none), nothing is held.
    assert CallStream().feed("{") == ("{", [])
