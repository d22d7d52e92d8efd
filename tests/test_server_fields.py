"""Every field of OpenAI's request bodies, as `flyspec serve` takes it: the table in
docs/server.md ("What a request may send") names each field of OpenAI's list once, and the
server does what the table says (200 where a field works or has no effect, 400 naming it where
it is refused)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flyspec.config import DecodeConfig
from flyspec.engine import Engine
from flyspec.server.app import create_app
from tests.test_server import MESSAGES, MODEL, POLL_LIMIT, PROMPT, running
from tests.tiny import make_tiny_model, make_tiny_tokenizer

DOC = Path(__file__).resolve().parents[1] / "docs" / "server.md"
# OpenAI's OpenAPI description, version 2.3.0: CreateChatCompletionRequest and
# CreateCompletionRequest.
OPENAI_CHAT = {
    "metadata", "top_logprobs", "temperature", "top_p", "user", "safety_identifier",
    "prompt_cache_key", "service_tier", "prompt_cache_retention", "messages", "model",
    "modalities", "verbosity", "reasoning_effort", "max_completion_tokens", "frequency_penalty",
    "presence_penalty", "web_search_options", "response_format", "audio", "store", "stream",
    "stop", "logit_bias", "logprobs", "max_tokens", "n", "prediction", "seed", "stream_options",
    "tools", "tool_choice", "parallel_tool_calls", "function_call", "functions",
}  # fmt: skip
OPENAI_COMPLETIONS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
}  # fmt: skip

# A value for each field that the table says works or has no effect: the request is answered.
ANSWERED = {
    "messages": MESSAGES,
    "prompt": PROMPT,
    "model": MODEL,
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "temperature": 0.7,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "seed": 7,
    "stream": False,
    "stream_options": {"include_usage": True},
    "prediction": {"type": "content", "content": "def f(): pass"},
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": -100},
    "user": "someone",
    "safety_identifier": "a-hash",
    "prompt_cache_key": "a-key",
    "metadata": {"purpose": "test"},
    "store": False,
    "service_tier": "auto",
    "modalities": ["text"],
    "parallel_tool_calls": False,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "none",
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": 0,  # with logprobs left out: nothing asked
    "echo": True,
    "suffix": "",
    "response_format": {"type": "json_object"},
}
# A value for each field the table refuses: a 400 naming the field.
REFUSED = {
    "n": 17,
    "best_of": 2,
    "store": True,
    "modalities": ["text", "audio"],
    "logprobs": 6,  # chat: not a boolean; completions: past 5 alternatives
    "top_logprobs": 21,
    "echo": True,  # with a suffix (REFUSED_WITH)
    "suffix": "return x",
    "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": []}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
    "tool_choice": "auto",  # without tools
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "prompt_cache_retention": "24h",
    "metadata": {f"k{i}": "v" for i in range(17)},
    "service_tier": "gold",
}


REFUSED_WITH = {"echo": {"suffix": "return x"}}
"""What a refused value is sent with, where it is refused only in company."""
ANSWERED_WITH = {"tool_choice": {"tools": ANSWERED["tools"]}}
"""What an answered value is sent with, where it means something only in company."""


def table() -> dict[str, str]:
    """``{field: verdict}`` from the docs' table (a row may name several fields)."""
    text = DOC.read_text()
    section = text.split("### What a request may send", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[2]
    return rows


def test_the_table_names_every_field_of_openais_list_once():
    assert set(table()) == OPENAI_CHAT | OPENAI_COMPLETIONS


def test_every_field_has_an_example_for_what_the_table_says():
    for name, verdict in table().items():
        if verdict.startswith(("works", "no effect")):
            assert name in ANSWERED, name
        if "refused" in verdict:
            assert name in REFUSED, name


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    tokenizer = make_tiny_tokenizer(96)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    target = make_tiny_model(vocab_size=96, seed=2, num_layers=1, **ids)
    engine = Engine(target_model=target, tokenizer=tokenizer)
    app = create_app(
        engine, defaults=DecodeConfig(mode="target", max_new_tokens=3), model_name=MODEL
    )
    with running(app) as url, httpx.Client(base_url=url, timeout=POLL_LIMIT) as client:
        yield client


def endpoints_of(name: str) -> list[tuple[str, dict]]:
    """The endpoints OpenAI defines ``name`` on, each with a minimal body."""
    found = []
    if name in OPENAI_CHAT:
        found.append(("/v1/chat/completions", {"messages": MESSAGES}))
    if name in OPENAI_COMPLETIONS:
        found.append(("/v1/completions", {"prompt": PROMPT}))
    return found


@pytest.mark.parametrize("name", sorted(ANSWERED))
def test_a_field_that_works_or_has_no_effect_is_answered(client, name):
    for endpoint, body in endpoints_of(name):
        body = {**body, **ANSWERED_WITH.get(name, {}), name: ANSWERED[name]}
        if name == "max_completion_tokens":
            body.pop("max_tokens", None)
        response = client.post(endpoint, json=body)
        assert response.status_code == 200, (endpoint, response.text)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_a_400_that_names_it(client, name):
    for endpoint, body in endpoints_of(name):
        body = {**body, **REFUSED_WITH.get(name, {}), name: REFUSED[name]}
        response = client.post(endpoint, json=body)
        assert response.status_code == 400, (endpoint, response.text)
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"], error
