"""Structured outputs through `flyspec serve`, driven by the official openai client on tiny
random-weight models: ``response_format`` ``json_schema`` (what ``beta.chat.completions.parse``
sends) and ``json_object``, on both endpoints, streamed and not, exact and FLy, and on the
llama.cpp backend; schemas the grammar engine cannot use, and malformed formats, are refused
naming ``response_format``."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.test_server import MODEL, openai_client

# Whitespace between JSON tokens is bounded (decoding/grammar.py), so an answer of fixed
# fields and enums ends within this budget even on a random model.
BUDGET = 600


class Verdict(BaseModel):
    ok: bool
    kind: Literal["x", "yy"]


MESSAGES = [{"role": "user", "content": "answer in JSON"}]


MODES = {
    "target": {"mode": "target"},
    "spd": {"mode": "spd"},
    "fly": {"mode": "fly", "theta": 0.0, "window": 0},
    "fly, ngram": {"mode": "fly", "drafter": "ngram", "theta": 0.0, "window": 1},
    "sampled": {"mode": "spd", "temperature": 1.0, "seed": 3},
}


@pytest.mark.parametrize("mode", MODES)
def test_parse_returns_the_pydantic_object(loose_client, mode):
    completion = loose_client.beta.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Verdict, extra_body=MODES[mode]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    assert Verdict.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_streamed_answer_under_a_schema_parses(loose_client):
    schema = Verdict.model_json_schema()
    stream = loose_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": schema, "strict": True},
        },
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Verdict.model_validate_json(text)


def test_json_object_on_both_endpoints_gives_an_object(loose_client):
    chat = loose_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        response_format={"type": "json_object"},
    )
    completion = loose_client.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=40,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for text, reason in (
        (chat.choices[0].message.content, chat.choices[0].finish_reason),
        (completion.choices[0].text, completion.choices[0].finish_reason),
    ):
        assert text.lstrip().startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens, as OpenAI's
            assert reason == "length"


def test_an_answer_cut_by_max_tokens_says_length(loose_client):
    completion = loose_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": {}}},
    )
    assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        ({"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "frob"}}}, "frob"),
        (
            {"type": "json_schema", "json_schema": {"name": "v", "schema": {"pattern": "(x"}}},
            "unclosed",
        ),
        ({"type": "xml"}, "json_object"),
        ({"type": "json_schema"}, "json_schema object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "v", "schema": []}}, "JSON object"),
        ({"type": "json_object", "schema": {}}, "unknown field"),
    ],
)
def test_a_format_that_cannot_be_used_is_a_400_naming_it(loose_client, response_format, named):
    with pytest.raises(openai.BadRequestError) as raised:
        loose_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, response_format=response_format
        )
    error = raised.value.body
    assert error["param"] == "response_format", error
    assert named in error["message"], error


def test_text_is_the_plain_answer(loose_client):
    plain = loose_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, seed=1
    )
    text = loose_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, seed=1, response_format={"type": "text"}
    )
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_the_llamacpp_backend_answers_under_a_schema(tiny_llamacpp_engine):
    pytest.importorskip("llama_cpp")
    with openai_client(tiny_llamacpp_engine, max_new_tokens=BUDGET) as client:
        for extra in ({"mode": "target"}, {"mode": "fly", "theta": 0.0, "window": 0}):
            completion = client.beta.chat.completions.parse(
                model=MODEL, messages=MESSAGES, response_format=Verdict, extra_body=extra
            )
            assert isinstance(completion.choices[0].message.parsed, Verdict)
