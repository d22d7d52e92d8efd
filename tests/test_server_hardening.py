"""`flyspec serve` against hostile or careless clients: invalid text, huge bodies, many
messages, missing or wrong API keys, very deep JSON, very long echoed values, and a model
folder without its tokenizer.

Servers run for real (uvicorn on a loopback port, in a thread) on tiny models. Where a test
needs the server to be busy preparing a request, :class:`GatedEngine` holds the preparation
on a gate the test opens: nothing depends on timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from flyspec.cli.serve import byte_size, refuse_flyspec_server_options, server_options
from flyspec.config import DecodeConfig
from flyspec.engine import Engine
from flyspec.errors import FlyspecError
from flyspec.models import load_tokenizer
from flyspec.server.access import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
    exposure_warning,
    is_loopback,
    resolve_api_key,
)
from flyspec.server.app import create_app
from tests.test_server import MESSAGES, MODEL, POLL_LIMIT, PROMPT, assert_error, running
from tests.tiny import make_tiny_model, make_tiny_tokenizer

KEY = "sk-test-0123456789"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def tiny_engine() -> Engine:
    """A tiny target-only engine (1024-token context)."""
    tokenizer = make_tiny_tokenizer(96)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    target = make_tiny_model(vocab_size=96, seed=2, num_layers=1, **ids)
    return Engine(target_model=target, tokenizer=tokenizer)


def target_defaults() -> DecodeConfig:
    return DecodeConfig(mode="target", max_new_tokens=4)


@pytest.fixture(scope="module")
def base_url(tiny_engine) -> Iterator[str]:
    """A server with the default limits and no key."""
    app = create_app(tiny_engine, defaults=target_defaults(), model_name=MODEL)
    with running(app) as url:
        yield url


@pytest.fixture()
def client(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=POLL_LIMIT) as client:
        yield client


def post_raw(client: httpx.Client, endpoint: str, body: bytes) -> httpx.Response:
    return client.post(endpoint, content=body, headers=JSON)


# ---------------------------------------------------------------- invalid text


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# Raw JSON: "\ud800" is a valid JSON escape but a lone surrogate, not Unicode text.
LONE_SURROGATES = [
    (COMPLETIONS, rb'{"prompt": "def f\ud800"}', "prompt"),
    (COMPLETIONS, rb'{"prompt": ["\udfff"]}', "prompt.0"),
    (COMPLETIONS, rb'{"prompt": "x", "stop": "\ud800"}', "stop"),
    (COMPLETIONS, rb'{"prompt": "x", "stop": ["ok", "a\udc00"]}', "stop.1"),
    (COMPLETIONS, rb'{"prompt": "x", "model": "\ud800"}', "model"),
    (COMPLETIONS, rb'{"prompt": "x", "user": "\ud800"}', "user"),
    (COMPLETIONS, rb'{"prompt": "x", "mode": "\ud800"}', "mode"),
    (COMPLETIONS, rb'{"prompt": "x", "logit_bias": {"\ud800": 1}}', "logit_bias"),
    (COMPLETIONS, rb'{"prompt": "x", "\ud800": 1}', None),
    (CHAT, rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages.0.content"),
    (
        CHAT,
        rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
        "messages.0.content.0.text",
    ),
    (
        CHAT,
        rb'{"messages": [{"role": "user", "content": "a", "name": "\ud800"}]}',
        "messages.0.name",
    ),
    (CHAT, rb'{"messages": [{"role": "user", "content": "a"}], "stop": "\ud800"}', "stop"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), LONE_SURROGATES)
def test_lone_surrogate_is_a_400_naming_the_field(client, endpoint, body, param):
    error = assert_error(post_raw(client, endpoint, body), 400, param)
    assert error["param"] == param
    assert error["code"] == "invalid_text"
    assert "not valid Unicode" in error["message"] and "surrogate" in error["message"]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_surrogate_pairs_are_text(client, endpoint):
    """A high-low pair is one character (U+1F600), not an error."""
    if endpoint == CHAT:
        body = rb'{"messages": [{"role": "user", "content": "hi \ud83d\ude00"}], "max_tokens": 2}'
    else:
        body = rb'{"prompt": "def \ud83d\ude00", "max_tokens": 2}'
    assert post_raw(client, endpoint, body).status_code == 200


# ---------------------------------------------------------------- size limits


def test_body_over_the_limit_is_a_413(client):
    big = json.dumps({"prompt": "a" * (4 * DEFAULT_MAX_BODY_BYTES)}).encode()
    error = assert_error(post_raw(client, COMPLETIONS, big), 413)
    assert error["code"] == "request_too_large"
    assert str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    assert client.get("/health").json()["status"] == "ok"
    assert 'endpoint="/v1/completions",status="413"' in client.get("/metrics").text


def test_chunked_body_over_the_limit_is_a_413_and_health_answers_meanwhile(client, base_url):
    """Without a Content-Length the bytes are counted as they arrive; while the upload is in
    progress (half the limit sent), /health answers."""
    chunk = b" " * (1024 * 1024)
    health: list[httpx.Response] = []

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for index in range(4 * DEFAULT_MAX_BODY_BYTES // len(chunk)):
            if index == 2:
                with httpx.Client(base_url=base_url, timeout=POLL_LIMIT) as other:
                    health.append(other.get("/health"))
            yield chunk
        yield b'"}'

    response = client.post(COMPLETIONS, content=body(), headers=JSON)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    error = assert_error(response, 413)
    assert error["code"] == "request_too_large"
    assert health and health[0].status_code == 200


def test_a_body_under_the_limit_is_served(tiny_engine):
    app = create_app(tiny_engine, defaults=target_defaults(), model_name=MODEL, max_body_bytes=200)
    with running(app) as url, httpx.Client(base_url=url, timeout=POLL_LIMIT) as client:
        small = {"prompt": PROMPT, "max_tokens": 2}
        assert len(json.dumps(small)) <= 200
        assert client.post(COMPLETIONS, json=small).status_code == 200
        assert_error(client.post(COMPLETIONS, json={**small, "user": "u" * 200}), 413)
        assert client.get("/health").status_code == 200


def test_too_many_chat_messages_is_a_400(tiny_engine):
    app = create_app(tiny_engine, defaults=target_defaults(), model_name=MODEL, max_messages=3)
    with running(app) as url, httpx.Client(base_url=url, timeout=POLL_LIMIT) as client:
        allowed = client.post(CHAT, json={"messages": MESSAGES * 3, "max_tokens": 2})
        assert allowed.status_code == 200, allowed.text
        error = assert_error(client.post(CHAT, json={"messages": MESSAGES * 4}), 400, "messages")
        assert error["code"] == "array_above_max_length"
        assert "4" in error["message"] and "3" in error["message"]


class GatedEngine:
    """The tiny engine, but preparing a prompt first waits for :attr:`release`; it sets
    :attr:`entered` when a preparation has started."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.has_draft = engine.has_draft
        self.vocab_size = engine.vocab_size
        self.context_length = engine.context_length
        self.entered = threading.Event()
        self.release = threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        assert self.release.wait(timeout=POLL_LIMIT), "the test never released the engine"

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        self._wait()
        return self.engine.encode(prompt, chat=chat)

    def encode_messages(self, messages) -> list[int]:
        self._wait()
        return self.engine.encode_messages(messages)

    def stream(self, *args, **kwargs):
        return self.engine.stream(*args, **kwargs)


@pytest.mark.parametrize(
    ("endpoint", "payload"),
    [
        (COMPLETIONS, {"prompt": "def fibonacci " * 75_000}),  # 1 MB
        (CHAT, {"messages": [{"role": "user", "content": "hi"}] * 100_000}),
    ],
    ids=["1MB-prompt", "100k-messages"],
)
def test_health_answers_while_a_huge_request_is_prepared(tiny_engine, endpoint, payload):
    """Templating and tokenizing run off the event loop: while a huge request (under raised
    limits) is being prepared, /health answers; then the request gets its answer (its
    prompt is far beyond the 1024-token context)."""
    engine = GatedEngine(tiny_engine)
    app = create_app(
        engine,
        defaults=target_defaults(),
        model_name=MODEL,
        max_body_bytes=64 * 1024**2,
        max_messages=200_000,
    )
    big: list[httpx.Response] = []
    with running(app) as url, httpx.Client(base_url=url, timeout=POLL_LIMIT) as client:

        def send() -> None:
            with httpx.Client(base_url=url, timeout=4 * POLL_LIMIT) as own:
                big.append(own.post(endpoint, json=payload))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            assert engine.entered.wait(timeout=POLL_LIMIT), "the big request was not prepared"
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert not big, "the big request finished while its preparation was held"
        finally:
            engine.release.set()
            sender.join(timeout=4 * POLL_LIMIT)
        error = assert_error(big[0], 400)
        assert error["code"] == "context_length_exceeded"
        assert client.get("/health").status_code == 200


# ---------------------------------------------------------------- API key


@pytest.fixture(scope="module")
def keyed_url(tiny_engine) -> Iterator[str]:
    app = create_app(tiny_engine, defaults=target_defaults(), model_name=MODEL, api_key=KEY)
    with running(app) as url:
        yield url


def test_openai_client_with_the_right_key(keyed_url):
    oai = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in oai.models.list()] == [MODEL]
    completion = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert completion.choices[0].finish_reason in ("stop", "length")
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert chat.choices[0].message.role == "assistant"


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x", KEY[:-1], None])
def test_openai_client_with_a_wrong_or_missing_key(keyed_url, key):
    """``None``: the client sends no Authorization header at all."""
    oai = openai.OpenAI(
        base_url=f"{keyed_url}/v1", api_key=key or "unused", max_retries=0, timeout=60
    )
    headers = {"Authorization": openai.omit} if key is None else None
    with pytest.raises(openai.AuthenticationError) as caught:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_headers=headers)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    # What the server saw: a key it refused, or none (openai 3.60 no longer shows the sent
    # Authorization header on the error's request).
    assert ("no API key" in caught.value.message) == (key is None)
    assert ("incorrect API key" in caught.value.message) == (key is not None)
    with pytest.raises(openai.AuthenticationError):
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers=headers
        )
    with pytest.raises(openai.AuthenticationError):
        oai.models.list(extra_headers=headers)


def test_key_is_checked_on_every_v1_path_and_infill_and_only_there(keyed_url):
    with httpx.Client(base_url=keyed_url, timeout=POLL_LIMIT) as client:
        for method, path in (
            ("POST", COMPLETIONS),
            ("POST", CHAT),
            ("POST", "/infill"),  # llama-server's route generates too
            ("GET", "/v1/models"),
            ("GET", f"/v1/models/{MODEL}"),
            ("GET", "/v1/no-such-route"),
        ):
            response = client.request(method, path, json={"prompt": "x"})
            error = assert_error(response, 401)
            assert error["code"] == "invalid_api_key" and error["param"] is None
            assert response.headers["www-authenticate"] == "Bearer"
        wrong = client.get("/v1/models", headers={"authorization": "Basic " + KEY})
        assert_error(wrong, 401)
        right = {"authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=right).status_code == 200
        assert client.get("/v1/no-such-route", headers=right).status_code == 404
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert 'endpoint="other",status="401"' in metrics.text


def test_metrics_can_require_the_key(tiny_engine):
    app = create_app(
        tiny_engine,
        defaults=target_defaults(),
        model_name=MODEL,
        api_key=KEY,
        metrics_require_key=True,
    )
    with running(app) as url, httpx.Client(base_url=url, timeout=POLL_LIMIT) as client:
        assert_error(client.get("/metrics"), 401)
        authorized = client.get("/metrics", headers={"authorization": f"Bearer {KEY}"})
        assert authorized.status_code == 200
        assert client.get("/health").status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        create_app(
            tiny_engine, defaults=target_defaults(), model_name=MODEL, metrics_require_key=True
        )


def test_docs_are_off_unless_asked_for(client, tiny_engine):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(client.get(path), 404)
    app = create_app(
        tiny_engine, defaults=target_defaults(), model_name=MODEL, docs=True, api_key=KEY
    )
    with running(app) as url, httpx.Client(base_url=url, timeout=POLL_LIMIT) as docs:
        assert docs.get("/docs").status_code == 200  # open even with a key
        assert docs.get("/redoc").status_code == 200
        schema = docs.get("/openapi.json").json()
        assert_error(docs.get("/v1/models"), 401)
    for path, field in ((COMPLETIONS, "prompt"), (CHAT, "messages")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert field in body["schema"]["properties"]
    # every $ref is a JSON pointer that resolves inside the document
    text = json.dumps(schema)
    refs = {part.split('"')[0] for part in text.split('"$ref": "')[1:]}
    assert refs
    for ref in refs:
        node = schema
        for step in ref.removeprefix("#/").split("/"):
            node = node[step.replace("~1", "/").replace("~0", "~")]
        assert isinstance(node, dict)


def test_serve_options_for_access_and_limits():
    from flyspec.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["serve"])
    options = server_options(args, api_key=None)
    assert options == {
        "api_key": None,
        "metrics_require_key": False,
        "docs": False,
        "max_body_bytes": DEFAULT_MAX_BODY_BYTES,
        "max_messages": DEFAULT_MAX_MESSAGES,
    }
    args = parse(
        [
            "serve",
            "--api-key",
            KEY,
            "--metrics-require-key",
            "--docs",
            "--max-body-bytes",
            "16M",
            "--max-messages",
            "10",
        ]
    )
    key = resolve_api_key(args.api_key, environ={})
    assert server_options(args, api_key=key) == {
        "api_key": KEY,
        "metrics_require_key": True,
        "docs": True,
        "max_body_bytes": 16 * 1024**2,
        "max_messages": 10,
    }
    with pytest.raises(FlyspecError, match="--metrics-require-key"):
        server_options(parse(["serve", "--metrics-require-key"]), api_key=None)
    with pytest.raises(FlyspecError, match="--max-messages"):
        server_options(parse(["serve", "--max-messages", "0"]), api_key=None)
    with pytest.raises(SystemExit):
        parse(["serve", "--max-body-bytes", "lots"])


def test_api_key_comes_from_the_option_then_the_environment():
    assert resolve_api_key(None, environ={}) is None
    assert resolve_api_key(None, environ={"FLYSPEC_API_KEY": ""}) is None
    assert resolve_api_key(None, environ={"FLYSPEC_API_KEY": f" {KEY}\n"}) == KEY
    assert resolve_api_key("from-option", environ={"FLYSPEC_API_KEY": KEY}) == "from-option"
    with pytest.raises(FlyspecError, match="empty"):
        resolve_api_key("  ", environ={})


def test_byte_sizes():
    assert byte_size("4194304") == 4 * 1024**2
    assert byte_size("512K") == byte_size("512kib") == byte_size("512KB") == 512 * 1024
    assert byte_size("4M") == byte_size("4MiB") == 4 * 1024**2
    assert byte_size("1g") == 1024**3
    for bad in ("0", "-1", "4X", "", "1.5M"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_no_warning_on_loopback(host):
    assert is_loopback(host)
    assert exposure_warning(host, api_key=None) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.com", ""])
def test_warning_beyond_loopback_without_a_key(host):
    assert not is_loopback(host)
    warning = exposure_warning(host, api_key=None)
    assert warning is not None and "without an API key" in warning
    assert "FLYSPEC_API_KEY" in warning
    assert exposure_warning(host, api_key=KEY) is None


def test_vllm_engine_refuses_flyspec_only_server_options():
    from flyspec.cli import build_parser

    parse = build_parser().parse_args
    refuse_flyspec_server_options(parse(["serve"]), api_key=None)
    with pytest.raises(FlyspecError, match="VLLM_API_KEY"):
        refuse_flyspec_server_options(parse(["serve"]), api_key=KEY)
    with pytest.raises(FlyspecError, match="--docs, --max-messages"):
        refuse_flyspec_server_options(
            parse(["serve", "--docs", "--max-messages", "5"]), api_key=None
        )


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "x", "stream_options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["top-level", "in-a-field"],
)
def test_deep_json_is_reported_as_too_deep(client, body):
    error = assert_error(post_raw(client, COMPLETIONS, body), 400)
    assert "nested too deep" in error["message"]
    assert "UTF-8" not in error["message"]
    assert error["code"] == "invalid_json"


def test_moderately_nested_json_is_parsed(client):
    nested = b'{"prompt": "x", "stream_options": {"a": ' + b"[" * 50 + b"]" * 50 + b"}}"
    assert post_raw(client, COMPLETIONS, nested).status_code == 200


def test_bodies_that_are_not_utf8_json(client):
    error = assert_error(post_raw(client, COMPLETIONS, b'{"prompt": "\xff"}'), 400)
    assert "not valid UTF-8" in error["message"] and "0xff" in error["message"]
    no_type = client.post(COMPLETIONS, content=b'{"prompt": "x"}', headers={"content-type": ""})
    assert "Content-Type: application/json" in assert_error(no_type, 400)["message"]
    vendor = {"content-type": "application/vnd.example+json; charset=utf-8"}
    assert client.post(COMPLETIONS, content=b'{"prompt": "x"}', headers=vendor).status_code == 200


LONG = "m" * 1_000_000


def assert_clipped(error: dict) -> None:
    assert len(error["message"]) < 500, error["message"][:600]
    assert "..." in error["message"]
    assert "1000000 characters" in error["message"]


def test_long_values_are_clipped_in_errors(client):
    for endpoint, extra in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": MESSAGES})):
        error = assert_error(client.post(endpoint, json={"model": LONG, **extra}), 404, "model")
        assert_clipped(error)
    error = assert_error(client.get(f"/v1/models/{'m' * 10_000}"), 404)
    assert len(error["message"]) < 500 and "(10000 characters)" in error["message"]
    assert len(assert_error(client.get(f"/nope/{'m' * 10_000}"), 404)["message"]) < 500
    error = assert_error(client.post(COMPLETIONS, json={"prompt": "x", "mode": LONG}), 400, "mode")
    assert len(error["message"]) < 500 and error["message"].startswith("mode must be one of")
    unknown = assert_error(client.post(COMPLETIONS, json={"prompt": "x", LONG: 1}), 400)
    assert len(unknown["message"]) < 500 and len(unknown["param"]) < 200


# ---------------------------------------------------------------- model folder


def test_model_folder_without_a_tokenizer(tiny_pair, tmp_path):
    draft, target = tiny_pair
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copy(Path(target) / "config.json", only_config / "config.json")
    with pytest.raises(FlyspecError) as caught:
        load_tokenizer(str(only_config))
    message = str(caught.value)
    assert str(only_config) in message and "has no tokenizer" in message
    assert "tokenizer.json" in message and "config.json" in message
    for draft_spec, target_spec in (
        (str(only_config), str(target)),
        (str(draft), str(only_config)),
    ):
        with pytest.raises(FlyspecError) as caught:
            Engine.load(target=target_spec, draft=draft_spec)
        assert "has no tokenizer" in str(caught.value)
        assert "different tokenizers" not in str(caught.value)
    assert len(load_tokenizer(str(target))) == 96


# ---------------------------------------------------------------- tiny temperatures


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-100, 1e-45, 1e-40, 1e-20, 1e-6])
def test_temperatures_too_small_to_divide_by_are_answered_greedily(client, temperature, stream):
    """Across the float range down to the smallest subnormal: 200 with the greedy text, never
    a 500 or an error chunk."""
    greedy = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 4}).json()
    payload = {"prompt": PROMPT, "max_tokens": 4, "temperature": temperature, "seed": 1}
    if not stream:
        response = client.post(COMPLETIONS, json=payload)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
        return
    with client.stream("POST", COMPLETIONS, json={**payload, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: ") :]) for line in lines]
    assert not any("error" in chunk for chunk in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == greedy["choices"][0]["text"]
