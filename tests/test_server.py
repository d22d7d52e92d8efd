"""`flyspec serve`: the real server (uvicorn on a loopback port, in a thread) on tiny models,
driven over HTTP with httpx and with the official openai client.

Slow or blocked generations use :class:`ScriptedEngine`, a stand-in whose ``stream`` yields one
token per step, optionally waiting on a gate or sleeping, so queueing, cancellation and time
limits are tested without depending on what a random model happens to generate. Waiting for
the server to reach a state polls ``/health`` or ``/metrics`` with a generous limit: nothing
asserts on timing.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from flyspec.config import DecodeConfig, SamplingConfig
from flyspec.decoding.stats import RequestStats, RoundStats
from flyspec.engine import FIM_TOKENS, REPOSITORY_TOKENS, Engine, TextChunk
from flyspec.server.app import create_app
from tests.tiny import make_tiny_model, make_tiny_tokenizer

MODEL = "tiny-test"
VOCAB = 96
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
MESSAGES = [{"role": "user", "content": "print the range of self"}]
POLL_LIMIT = 30.0


# ---------------------------------------------------------------- helpers and fixtures


def loosening_engine() -> Engine:
    """A tiny pair whose draft differs from the target (FLy keeps some tokens loosely)."""
    tokenizer = make_tiny_tokenizer(VOCAB)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    target = make_tiny_model(vocab_size=VOCAB, seed=2, num_layers=2, **ids)
    draft = make_tiny_model(vocab_size=VOCAB, seed=3, num_layers=1, **ids)
    return Engine(target_model=target, draft_model=draft, tokenizer=tokenizer)


@contextlib.contextmanager
def openai_client(engine, *, max_new_tokens: int, model: str = MODEL) -> Iterator[openai.OpenAI]:
    """The official openai client of ``engine`` served as ``model`` (K=4, ``max_new_tokens``
    by default) on a free loopback port."""
    app = create_app(
        engine,
        defaults=DecodeConfig(k=4, max_new_tokens=max_new_tokens),
        model_name=model,
        queue_size=4,
        request_timeout=120,
    )
    with running(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + POLL_LIMIT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=POLL_LIMIT)
        sock.close()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + POLL_LIMIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def post_in_background(
    client: httpx.Client, payload: dict, endpoint: str = "/v1/completions"
) -> tuple[threading.Thread, list[httpx.Response]]:
    """POST from another thread (own connection); the response lands in the returned list."""
    results: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=client.base_url, timeout=60) as own:
            results.append(own.post(endpoint, json=payload))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, results


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The ``data:`` payloads of a server-sent event stream (``[DONE]`` kept as a string)."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric_samples(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed by prometheus_client: {(sample name, sorted labels): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    return metric_samples(client).get((name, tuple(sorted(labels.items()))), 0.0)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if status < 500 and status != 429:
        assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_speculative(body: dict, mode: str) -> None:
    spec = body["speculative"]
    assert set(spec) >= {
        "mode",
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
    }
    assert spec["mode"] == mode
    assert spec["accepted"] + spec["loosely_accepted"] + spec["rejected"] == spec["drafted"]
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if spec["rounds"]:
        assert spec["tau"] == pytest.approx(usage["completion_tokens"] / spec["rounds"], abs=1e-3)
    if mode == "target":
        assert spec["drafted"] == 0


@pytest.fixture(scope="module")
def tiny_engine() -> Engine:
    """A tiny pair: the draft has the target's weights, so drafts are mostly accepted."""
    tokenizer = make_tiny_tokenizer(VOCAB)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    target = make_tiny_model(vocab_size=VOCAB, seed=2, num_layers=2, **ids)
    draft = make_tiny_model(vocab_size=VOCAB, seed=2, num_layers=2, **ids)
    return Engine(target_model=target, draft_model=draft, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def base_url(tiny_engine) -> Iterator[str]:
    app = create_app(
        tiny_engine,
        defaults=DecodeConfig(k=4, max_new_tokens=16),
        model_name=MODEL,
        queue_size=4,
        request_timeout=120,
    )
    with running(app) as url:
        yield url


@pytest.fixture()
def client(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.fixture()
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


class ScriptedEngine:
    """Stands in for an Engine: tokenises with a real tiny engine, but ``stream`` yields the
    token ``a`` ``max_new_tokens`` times, waiting on :attr:`gate` and sleeping :attr:`delay`
    before each one (one round of 2 drafted / 1 accepted per token)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.has_draft = engine.has_draft
        self.vocab_size = engine.vocab_size
        self.context_length = 1_000_000
        self.token_id = engine.tokenizer.convert_tokens_to_ids("a")
        self.reset()

    def reset(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0
        self.fail = False
        self.started = 0
        self.stopped_early = 0
        self.tokens = 0

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        return self.engine.encode(prompt, chat=chat)

    def encode_messages(self, messages) -> list[int]:
        return self.engine.encode_messages(messages)

    def stream(
        self,
        prompt_ids,
        config: DecodeConfig,
        *,
        stats: RequestStats | None = None,
        should_stop=None,
        prediction=None,
        logprobs=None,
        grammar=None,
    ):
        stats = stats if stats is not None else RequestStats()
        stats.prompt_tokens = len(prompt_ids)
        self.started += 1
        try:
            for _ in range(config.max_new_tokens):
                assert self.gate.wait(timeout=POLL_LIMIT), "the test never opened the gate"
                time.sleep(self.delay)
                if self.fail:
                    raise RuntimeError("scripted failure")
                stats.add_round(RoundStats(2, 1, 0, 1, 0.0, 0.0))
                self.tokens += 1
                yield TextChunk(text="a", token=self.token_id, origin="exact")
                if should_stop is not None and should_stop():
                    self.stopped_early += 1
                    stats.finish_reason = "cancelled"
                    return
            stats.finish_reason = "length"
        except GeneratorExit:
            self.stopped_early += 1
            raise


@pytest.fixture(scope="module")
def scripted_server(tiny_engine) -> Iterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine(tiny_engine)
    app = create_app(
        engine,
        defaults=DecodeConfig(k=4, max_new_tokens=8),
        model_name=MODEL,
        queue_size=1,
        request_timeout=120,
    )
    with running(app) as url:
        yield url, engine
        engine.gate.set()


@pytest.fixture()
def scripted(scripted_server) -> Iterator[tuple[httpx.Client, ScriptedEngine]]:
    url, engine = scripted_server
    engine.reset()
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client, engine
    engine.gate.set()


# ---------------------------------------------------------------- endpoints


def test_health_and_models(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["queue"] == {"waiting": 0, "running": 0, "size": 4}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404, "model")


@pytest.mark.parametrize("mode", ["target", "spd", "fly"])
def test_completion(client, tiny_engine, mode):
    response = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "mode": mode, "k": 3},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 12 or choice["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(tiny_engine.encode(PROMPT))
    assert_speculative(body, mode)
    if mode != "target":  # the draft has the target's weights: greedy drafts are accepted
        assert body["speculative"]["accepted"] > 0


def test_lossless_settings_give_the_targets_greedy_text(client):
    """Exact SPD, and FLy with theta = inf (sent as the string "inf"), are lossless."""
    texts = []
    lossless = [
        {"mode": "target"},
        {"mode": "spd", "k": 6},
        {"mode": "fly", "theta": "inf"},
        {"mode": "fly", "theta": "inf", "min_ratio": 0.5, "max_rank": 3, "defer": True},
        {"mode": "fly", "theta": "inf", "max_draft_confidence": 0.5},
    ]
    for extra in lossless:
        body = client.post(
            "/v1/completions", json={"prompt": [PROMPT], "max_tokens": 16, **extra}
        ).json()
        texts.append(body["choices"][0]["text"])
    assert texts[0] and all(text == texts[0] for text in texts[1:])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_text_equals_non_streamed_text(client, endpoint):
    chat = endpoint.endswith("chat/completions")
    request = {"max_tokens": 16, "mode": "fly", "k": 4, "temperature": 0}
    request.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
    plain = client.post(endpoint, json=request).json()
    with client.stream("POST", endpoint, json={**request, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(isinstance(c, dict) and c["id"] == chunks[0]["id"] for c in chunks)
    final = chunks[-1]
    if chat:
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        expected = plain["choices"][0]["message"]["content"]
    else:
        assert all(c["object"] == "text_completion" for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        expected = plain["choices"][0]["text"]
    assert text == expected
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert final["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert final["usage"] == plain["usage"]
    assert_speculative(final, "fly")
    for name in ("rounds", "drafted", "accepted", "loosely_accepted", "rejected", "tau"):
        assert final["speculative"][name] == plain["speculative"][name]


def test_chat_completion(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "be short"},
                {"role": "user", "content": [{"type": "text", "text": "def fibonacci"}]},
            ],
            "max_completion_tokens": 10,
            "mode": "spd",
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert body["usage"]["completion_tokens"] <= 10
    assert_speculative(body, "spd")


def test_stop_strings(client):
    full = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "mode": "target"}
    ).json()["choices"][0]["text"]
    assert len(full) >= 6, full
    stop = full[3:5]
    for stop_field in (stop, [stop, "never-generated-zz"]):
        body = client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 16, "mode": "fly", "stop": stop_field},
        ).json()
        assert body["choices"][0]["text"] == full[: full.find(stop)]
        assert body["choices"][0]["finish_reason"] == "stop"


def test_openai_client(oai):
    completion = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"mode": "fly", "k": 5, "window": 2, "theta": 0.5},
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    speculative = completion.model_extra["speculative"]
    assert speculative["mode"] == "fly"
    assert (
        speculative["accepted"] + speculative["loosely_accepted"] + speculative["rejected"]
        == speculative["drafted"]
    )
    assert completion.usage.completion_tokens <= 10

    streamed = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"mode": "fly", "k": 5, "window": 2, "theta": 0.5},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens

    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, seed=3)
    assert chat.choices[0].message.role == "assistant"
    assert chat.model_extra["speculative"]["mode"] == "fly"
    stream = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, seed=3, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content

    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"k": 0})
    assert caught.value.body["param"] == "k"


def test_penalties_and_biases_decode_as_the_library_does(oai, tiny_engine):
    """presence_penalty, frequency_penalty, logit_bias (and repetition_penalty, an
    extension) reach the decoder: the server's text is the library's with the same settings,
    and a bias of -100 keeps a token out of the answer."""
    plain = tiny_engine.generate(PROMPT, DecodeConfig(mode="target", max_new_tokens=16))
    banned = plain.token_ids[2]
    sampling = SamplingConfig(
        presence_penalty=0.8,
        frequency_penalty=1.2,
        repetition_penalty=1.3,
        logit_bias=((banned, -100.0), (plain.token_ids[0], 5.0)),
    )
    for mode in ("target", "spd", "fly"):
        expected = tiny_engine.generate(
            PROMPT, DecodeConfig(mode=mode, k=4, max_new_tokens=16, sampling=sampling)
        )
        assert banned not in expected.token_ids and expected.token_ids != plain.token_ids
        completion = oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            presence_penalty=0.8,
            frequency_penalty=1.2,
            logit_bias={str(banned): -100, str(plain.token_ids[0]): 5},
            extra_body={"mode": mode, "k": 4, "repetition_penalty": 1.3},
        )
        assert completion.choices[0].text == expected.text


def test_logprobs_are_the_engines_with_their_origins(oai, tiny_engine):
    """Chat ``logprobs`` with ``top_logprobs``, completions' ``logprobs``: each token's
    log-probability is the library's, streamed or not, with how the token was obtained."""
    config = DecodeConfig(mode="fly", k=4, max_new_tokens=12)
    expected = tiny_engine.generate(tiny_engine.encode_messages(MESSAGES), config, logprobs=2)
    extra = {"mode": "fly", "k": 4}
    request = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    chat = oai.chat.completions.create(**request)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(expected.token_ids)
    for entry, record, origin in zip(content, expected.logprobs, expected.origins, strict=True):
        assert entry.logprob == pytest.approx(record.logprob)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in record.top])
        assert entry.model_extra["origin"] == origin
        assert bytes(entry.bytes).decode() == entry.token
    # The tokens' texts make the answer, special tokens (which the answer leaves out) apart.
    special = set(tiny_engine.tokenizer.all_special_tokens)
    kept = [entry.token for entry in content if entry.token not in special]
    assert "".join(kept) == chat.choices[0].message.content
    streamed = oai.chat.completions.create(**request, stream=True)
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in entries] == [e.logprob for e in content]

    completion = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3, extra_body=extra
    )
    logprobs = completion.choices[0].logprobs
    assert (
        len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    )
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    kept = [token for token in logprobs.tokens if token not in special]
    assert logprobs.text_offset[0] == 0 and "".join(kept) == completion.choices[0].text
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_decoded_one_after_another_each_with_its_seed(oai, tiny_engine):
    prompt_ids = tiny_engine.encode_messages(MESSAGES)
    sampling = SamplingConfig(temperature=1.0, seed=5)
    expected = [
        tiny_engine.generate(
            prompt_ids,
            DecodeConfig(mode="fly", k=4, max_new_tokens=8, sampling=replace(sampling, seed=5 + i)),
        )
        for i in range(3)
    ]
    request = dict(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5, n=3,
        extra_body={"mode": "fly", "k": 4},
    )  # fmt: skip
    chat = oai.chat.completions.create(**request)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == [e.text for e in expected]
    assert chat.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert all(c.model_extra["speculative"]["mode"] == "fly" for c in chat.choices)
    texts = ["", "", ""]
    finished = []
    for chunk in oai.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert texts == [e.text for e in expected] and finished == [0, 1, 2]
    greedy = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_echo_puts_the_prompt_before_each_choice(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**body, "echo": True, "n": 2}).json()
    assert [c["text"] for c in echoed["choices"]] == [PROMPT + plain] * 2
    with client.stream("POST", "/v1/completions", json={**body, "echo": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == PROMPT + plain


def test_echo_with_logprobs_scores_the_prompt_then_the_answer(client, tiny_engine):
    """What evaluation harnesses send: the prompt's tokens' log-probabilities under the
    target (the first null), before the answer's; with ``max_tokens`` 0, the prompt alone."""
    prompt_ids = tiny_engine.encode(PROMPT)
    reference = tiny_engine.prompt_logprobs(prompt_ids, top=2)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    count = len(prompt_ids)
    assert choice["text"].startswith(PROMPT) and len(logprobs["tokens"]) == count + 4
    assert "".join(logprobs["tokens"][:count]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:count] == pytest.approx(
        [record.logprob for record in reference[1:]], abs=1e-5
    )
    assert logprobs["origins"][:count] == ["prompt"] * count
    assert logprobs["text_offset"][count] == len(PROMPT)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    # The prompt alone: max_tokens 0, streamed or not.
    alone = client.post("/v1/completions", json={**body, "max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == PROMPT
    assert alone["choices"][0]["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:count]
    streamed = {**body, "max_tokens": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=streamed) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == PROMPT
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        logprobs["token_logprobs"][1:count], abs=1e-5
    )
    refused = client.post("/v1/completions", json={**body, "echo": False, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def fim_engine(*, repository: bool = False) -> Engine:
    """A tiny engine whose tokenizer has Qwen2.5-Coder's fill-in-the-middle tokens, and with
    ``repository`` its repository tokens too."""
    special = [*FIM_TOKENS[0], *(REPOSITORY_TOKENS[0] if repository else ())]
    tokenizer = make_tiny_tokenizer(VOCAB - len(special))
    tokenizer.add_tokens(special, special_tokens=True)
    assert len(tokenizer) == VOCAB
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    target = make_tiny_model(vocab_size=VOCAB, seed=2, num_layers=2, **ids)
    return Engine(target_model=target, draft_model=target, tokenizer=tokenizer)


def test_a_suffix_fills_in_the_middle_through_the_models_tokens(client):
    engine = fim_engine()
    prefix, suffix = "def fibonacci(n):\n    ", "\n    return a\n"
    ids = engine.encode_infill(prefix, suffix)
    before, after, middle = (engine.tokenizer.convert_tokens_to_ids(t) for t in FIM_TOKENS[0])
    assert ids[0] == before and ids[-1] == middle and ids.count(after) == 1
    assert engine.tokenizer.decode(ids[1 : ids.index(after)]) == prefix
    app = create_app(engine, defaults=DecodeConfig(mode="fly", k=4), model_name=MODEL)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as fim:
        for mode in ("target", "spd", "fly"):
            config = DecodeConfig(mode=mode, k=4, max_new_tokens=12)
            expected = engine.generate(ids, config).text
            body = {"prompt": prefix, "suffix": suffix, "max_tokens": 12, "mode": mode, "k": 4}
            response = fim.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
    # A model without such tokens: 400, naming the field.
    refused = client.post("/v1/completions", json={"prompt": PROMPT, "suffix": "x"})
    assert_error(refused, 400, "suffix")
    assert "no fill-in-the-middle tokens" in refused.json()["error"]["message"]


@pytest.mark.parametrize("repository", [False, True])
def test_llama_servers_infill_fills_in_the_middle_with_the_projects_files(repository, client):
    """``/infill`` as llama.cpp's editor plugins send it: the project's other files before
    the gap (in the repository format where the model has one), the middle's start after
    it, llama.cpp's own fields taken; the answer in llama-server's shape, whole or streamed,
    the same text as the engine's own."""
    engine = fim_engine(repository=repository)
    prefix, suffix, start = "def fibonacci(n):\n    ", "\n    return a\n", "a"
    files = [("util.py", "import os\n"), ("main.py", "print(1)\n")]
    ids = engine.encode_infill(prefix, suffix, files=files, middle=start)
    before, after, middle = (engine.tokenizer.convert_tokens_to_ids(t) for t in FIM_TOKENS[0])
    assert ids.count(before) == ids.count(after) == ids.count(middle) == 1
    assert engine.tokenizer.decode(ids[ids.index(middle) + 1 :]) == start
    separator = engine.tokenizer.convert_tokens_to_ids(REPOSITORY_TOKENS[0][1])
    assert ids.count(separator) == (len(files) + 1 if repository else 0)
    context = engine.tokenizer.decode(ids[: ids.index(before)], skip_special_tokens=True)
    assert "util.py" in context and "print(1)" in context
    assert engine.encode_infill(prefix, suffix) == ids[ids.index(before) : ids.index(middle) + 1]
    app = create_app(engine, defaults=DecodeConfig(mode="fly", k=4), model_name=MODEL)
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=12)
    expected = engine.generate(ids, config).text
    body = {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [{"filename": name, "text": text, "time": 1.5} for name, text in files],
        "prompt": start,
        "n_predict": 12,
        "mode": "spd",
        "k": 4,
        "cache_prompt": True,  # llama.cpp's own settings: taken, without effect here
        "samplers": ["top_k", "top_p", "temperature"],
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
        "n_indent": 4,
    }
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as infill:
        answer = infill.post("/infill", json=body)
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result["content"] == expected and result["stop"] is True
        assert result["tokens_evaluated"] == len(ids) and 0 < result["tokens_predicted"] <= 12
        assert result["timings"]["predicted_n"] == result["tokens_predicted"]
        assert result["speculative"]["mode"] == "spd"
        fields = ["content", "timings/predicted_n", "timings/no_such", "tokens_cached"]
        cut = infill.post("/infill", json={**body, "response_fields": fields}).json()
        assert set(cut) == {"content", "timings/predicted_n", "tokens_cached"}
        assert cut["content"] == expected
        assert cut["timings/predicted_n"] == result["tokens_predicted"]
        with infill.stream("POST", "/infill", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data:")]
        assert "".join(e["content"] for e in events) == expected
        assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
        for field, value, param in [
            ("suffix", "x", "suffix"),
            ("input_extra", [{"name": "a.py"}], "input_extra.0.name"),
            ("n", 2, "n"),
            ("slot_save", True, "slot_save"),
        ]:
            assert_error(infill.post("/infill", json={**body, field: value}), 400, param)
    # A model without fill-in-the-middle tokens: 400, naming the field.
    refused = client.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix})
    assert_error(refused, 400, "input_prefix")


# ---------------------------------------------------------------- bad input


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": -3}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_k": -1}, "top_k"),
    ({"prompt": PROMPT, "stop": 5}, "stop"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"prompt": PROMPT, "mode": "fast"}, "mode"),
    ({"prompt": PROMPT, "drafter": "oracle"}, "drafter"),
    ({"prompt": PROMPT, "k": 0}, "k"),
    ({"prompt": PROMPT, "k": "4"}, "k"),
    ({"prompt": PROMPT, "window": -1}, "window"),
    ({"prompt": PROMPT, "theta": -0.5}, "theta"),
    ({"prompt": PROMPT, "theta": "high"}, "theta"),
    ({"prompt": PROMPT, "entropy": "full"}, "entropy"),
    ({"prompt": PROMPT, "min_ratio": 1.5}, "min_ratio"),
    ({"prompt": PROMPT, "max_draft_confidence": 2}, "max_draft_confidence"),
    ({"prompt": PROMPT, "max_rank": -2}, "max_rank"),
    ({"prompt": PROMPT, "defer": "sometimes"}, "defer"),
    ({"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    ({"prompt": PROMPT, "thetta": 0.3}, "thetta"),
    ({"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "frequency_penalty": "high"}, "frequency_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": "up"}}, "logit_bias.5"),
    ({"prompt": PROMPT, "logit_bias": {str(VOCAB + 4): 1}}, "logit_bias"),
]

BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MESSAGES, "n": 17}, "n"),
    ({"messages": MESSAGES, "k": -2}, "k"),
]


@pytest.mark.parametrize(("payload", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(client, payload, param):
    assert_error(client.post("/v1/completions", json=payload), 400, param)


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": 1024}, "max_tokens"),
        ({"prompt": "a " * 1100}, "prompt"),
        ({"prompt": "a " * 1100, "max_tokens": 1}, "prompt"),
    ],
)
def test_prompt_plus_max_tokens_past_the_context(client, tiny_engine, payload, param):
    assert tiny_engine.context_length == 1024
    error = assert_error(client.post("/v1/completions", json=payload), 400, param)
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("payload", "param"), BAD_CHATS)
def test_bad_chat_requests(client, payload, param):
    assert_error(client.post("/v1/chat/completions", json=payload), 400, param)


def test_unknown_model_is_404(client):
    for endpoint, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        error = assert_error(client.post(endpoint, json={"model": "gpt-4", **extra}), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b'{"prompt": "x", ', "application/json"),
        (b"\xff\xfe\x00", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'"just a string"', "application/json"),
        (b"", "application/json"),
        (b'{"prompt": "x"}', "text/plain"),
    ],
)
def test_malformed_bodies(client, content, content_type):
    response = client.post(
        "/v1/completions", content=content, headers={"content-type": content_type}
    )
    assert_error(response, 400)


def test_wrong_paths_and_methods(client):
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.post("/v1/unknown", json={}), 404)


def test_server_keeps_serving_after_bad_requests(client):
    for payload, _ in BAD_COMPLETIONS[:8]:
        client.post("/v1/completions", json=payload)
    client.post("/v1/completions", content=b"{{{", headers={"content-type": "application/json"})
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert response.status_code == 200
    assert client.get("/health").json()["status"] == "ok"


# ---------------------------------------------------------------- queue, cancellation, limits


def test_full_queue_answers_429(scripted):
    client, engine = scripted
    engine.gate.clear()  # the running generation blocks before its first token
    request = {"prompt": "x", "max_tokens": 2}
    first, first_result = post_in_background(client, request)
    wait_until(lambda: client.get("/health").json()["queue"]["running"] == 1, "a running job")
    second, second_result = post_in_background(client, request)
    wait_until(lambda: client.get("/health").json()["queue"]["waiting"] == 1, "a waiting job")
    assert metric(client, "flyspec_queue_length") == 1

    refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    error = assert_error(refused, 429)
    assert error["code"] == "rate_limit_exceeded"
    assert refused.headers.get("retry-after") == "1"
    streamed = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert_error(streamed, 429)

    engine.gate.set()
    first.join(timeout=POLL_LIMIT)
    second.join(timeout=POLL_LIMIT)
    assert first_result[0].status_code == 200 and second_result[0].status_code == 200
    assert first_result[0].json()["choices"][0]["text"] == "aa"
    assert metric(client, "flyspec_requests_total", endpoint="/v1/completions", status="429") >= 2
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_waiting_client_that_leaves_frees_its_place(scripted):
    client, engine = scripted
    engine.gate.clear()
    runner, results = post_in_background(client, {"prompt": "x", "max_tokens": 1})
    wait_until(lambda: client.get("/health").json()["queue"]["running"] == 1, "a running job")
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as waiting:
        assert waiting.status_code == 200
        wait_until(lambda: client.get("/health").json()["queue"]["waiting"] == 1, "a waiting job")
    wait_until(lambda: client.get("/health").json()["queue"]["waiting"] == 0, "the place freed")
    engine.gate.set()
    runner.join(timeout=POLL_LIMIT)
    assert results[0].status_code == 200
    assert engine.started == 1  # the request that left never reached the engine


def test_streaming_client_disconnect_cancels_generation(scripted):
    client, engine = scripted
    engine.delay = 0.01  # 1000 tokens would take 10 s or more
    before = metric(client, "flyspec_generations_total", mode="fly", outcome="cancelled")
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "stream": True}
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk read; leaving the block closes the connection
    wait_until(
        lambda: (
            metric(client, "flyspec_generations_total", mode="fly", outcome="cancelled")
            == before + 1
        ),
        "the cancelled generation",
    )
    assert engine.stopped_early == 1
    assert engine.tokens < 1000
    assert metric(client, "flyspec_requests_total", endpoint="/v1/completions", status="499") >= 1
    assert client.get("/health").json()["queue"] == {"waiting": 0, "running": 0, "size": 1}
    assert client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"]


def test_non_streaming_client_disconnect_cancels_generation(scripted):
    client, engine = scripted
    engine.delay = 0.01
    before = metric(client, "flyspec_generations_total", mode="fly", outcome="cancelled")
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000}, timeout=0.5)
    wait_until(
        lambda: (
            metric(client, "flyspec_generations_total", mode="fly", outcome="cancelled")
            == before + 1
        ),
        "the cancelled generation",
    )
    assert engine.stopped_early == 1 and engine.tokens < 1000


def test_request_timeout_ends_with_length(tiny_engine):
    engine = ScriptedEngine(tiny_engine)
    engine.delay = 0.01
    app = create_app(
        engine, defaults=DecodeConfig(), model_name=MODEL, queue_size=2, request_timeout=0.3
    )
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000}).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["speculative"]["timed_out"] is True
        assert 0 < body["usage"]["completion_tokens"] < 5000
        assert body["choices"][0]["text"] == "a" * body["usage"]["completion_tokens"]

        with client.stream(
            "POST", "/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
        ) as response:
            events = sse_events(response)
        final = events[-2]
        assert events[-1] == "[DONE]"
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["speculative"]["timed_out"] is True
        assert metric(client, "flyspec_generations_total", mode="fly", outcome="timeout") == 2


def test_engine_failure_is_a_500_and_the_server_survives(scripted):
    client, engine = scripted
    engine.fail = True
    error = assert_error(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert error["type"] == "server_error"
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    engine.fail = False
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


# ---------------------------------------------------------------- metrics and CLI


def test_metrics_are_prometheus_text(client):
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "mode": "spd"})
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    samples = metric_samples(client)
    names = {name for name, _ in samples}
    for expected in (
        "flyspec_requests_total",
        "flyspec_prompt_tokens_total",
        "flyspec_generated_tokens_total",
        "flyspec_rounds_total",
        "flyspec_drafted_tokens_total",
        "flyspec_accepted_tokens_total",
        "flyspec_loosely_accepted_tokens_total",
        "flyspec_rejected_tokens_total",
        "flyspec_tau_bucket",
        "flyspec_tau_count",
        "flyspec_queue_length",
        "flyspec_requests_running",
        "flyspec_request_duration_seconds_bucket",
        "flyspec_request_duration_seconds_sum",
    ):
        assert expected in names, expected
    spd = (("mode", "spd"),)
    assert samples[("flyspec_drafted_tokens_total", spd)] == (
        samples[("flyspec_accepted_tokens_total", spd)]
        + samples.get(("flyspec_loosely_accepted_tokens_total", spd), 0)
        + samples[("flyspec_rejected_tokens_total", spd)]
    )
    ok = (("endpoint", "/v1/completions"), ("status", "200"))
    bad = (("endpoint", "/v1/completions"), ("status", "400"))
    assert samples[("flyspec_requests_total", ok)] >= 1
    assert samples[("flyspec_requests_total", bad)] >= 1
    assert samples[("flyspec_queue_length", ())] == 0
    inf_bucket = (("endpoint", "/v1/completions"), ("le", "+Inf"))
    assert samples[("flyspec_request_duration_seconds_bucket", inf_bucket)] >= 2


def test_serve_command_line():
    from flyspec.cli import build_parser
    from flyspec.cli.options import decode_config_from_args
    from flyspec.cli.serve import run_serve
    from flyspec.server.access import default_model_name

    args = build_parser().parse_args(
        ["serve", "--port", "0", "--mode", "spd", "-k", "7", "--queue-size", "3"]
    )
    assert args.handler is run_serve
    assert (args.host, args.port, args.queue_size, args.request_timeout) == ("127.0.0.1", 0, 3, 600)
    config = decode_config_from_args(args)
    assert (config.mode, config.k) == ("spd", 7)
    assert default_model_name(None, "/cache/models/Qwen2.5-Coder-1.5B-Instruct") == (
        "Qwen2.5-Coder-1.5B-Instruct"
    )
    assert default_model_name("org/some-model", "org/some-model") == "org/some-model"
    assert default_model_name(None, "/x/model-q4.gguf") == "model-q4"


# ---------------------------------------------------------------- the engine thread


class ThreadRecordingEngine(ScriptedEngine):
    """A :class:`ScriptedEngine` that records the thread each generation runs on."""

    def stream(
        self,
        prompt_ids,
        config,
        *,
        stats=None,
        should_stop=None,
        prediction=None,
        logprobs=None,
        grammar=None,
    ):
        self.threads.append(threading.get_ident())
        yield from super().stream(prompt_ids, config, stats=stats, should_stop=should_stop)


def test_generations_run_on_the_thread_that_loaded_the_engine(tiny_engine):
    """Every generation runs on the executor given to create_app (flyspec serve loads the
    models there), and closing the app leaves that executor to its owner."""
    from flyspec.server.scheduler import engine_thread

    executor = engine_thread()
    loader = executor.submit(threading.get_ident).result()
    engine = ThreadRecordingEngine(tiny_engine)
    engine.threads = []
    app = create_app(
        engine,
        defaults=DecodeConfig(mode="target", max_new_tokens=2),
        model_name=MODEL,
        engine_executor=executor,
    )
    with running(app) as url:
        for _ in range(2):
            response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}, timeout=60)
            assert response.status_code == 200, response.text
    assert engine.threads == [loader, loader]
    assert executor.submit(threading.get_ident).result() == loader  # still open
    executor.shutdown()


# ------------------------------------------------------------------ Predicted Outputs

EXACT = {"mode": "spd", "drafter": "ngram", "k": 6}


def test_openai_client_prediction_round_trip(oai):
    """Exact decoding with a prediction gives the text it gives without one; the usage says
    how many predicted tokens were kept, streamed and not, on both endpoints."""
    plain = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=EXACT
    )
    text = plain.choices[0].text
    assert text and plain.usage.completion_tokens_details is None
    predicted = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={**EXACT, "prediction": {"type": "content", "content": text}},
    )
    assert predicted.choices[0].text == text
    details = predicted.usage.completion_tokens_details
    # The text, tokenized again, need not give the generated tokens (tests/test_prediction.py
    # pins a prediction of the very tokens): most are kept all the same.
    assert details.accepted_prediction_tokens > details.rejected_prediction_tokens
    speculative = predicted.model_extra["speculative"]
    assert details.accepted_prediction_tokens <= speculative["accepted"]

    stream = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={**EXACT, "prediction": {"type": "content", "content": text}},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text
    streamed = chunks[-1].usage.completion_tokens_details
    assert streamed.accepted_prediction_tokens == details.accepted_prediction_tokens

    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, extra_body=EXACT
    )
    reply = chat.choices[0].message.content
    parts = [{"type": "text", "text": reply[:5]}, {"type": "text", "text": reply[5:]}]
    chat_predicted = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        prediction={"type": "content", "content": parts},
        extra_body=EXACT,
    )
    assert chat_predicted.choices[0].message.content == reply
    assert chat_predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": reply},
        extra_body=EXACT,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_prediction_counts_add_up_to_the_drafted_tokens(client):
    """A prediction that is wrong from its start: its tokens are drafted and rejected, and
    kept plus rejected is what was drafted from it."""
    body = client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 16,
            "prediction": {"type": "content", "content": "zzzz qqqq zzzz qqqq"},
            **EXACT,
        },
    ).json()
    details = body["usage"]["completion_tokens_details"]
    assert details["rejected_prediction_tokens"] > 0
    speculative = body["speculative"]
    assert (
        details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
        <= (speculative["drafted"])
    )


@pytest.mark.parametrize(
    ("prediction", "message"),
    [
        ("def f(): pass", 'must be an object {"type": "content"'),
        ({"type": "text", "content": "x"}, 'must be an object {"type": "content"'),
        ({"content": "x"}, 'must be an object {"type": "content"'),
        ({"type": "content", "content": ""}, "prediction.content is empty"),
        ({"type": "content", "content": []}, "prediction.content is empty"),
        ({"type": "content", "content": 5}, "must be a string or a list of text parts"),
        ({"type": "content", "content": [{"type": "image"}]}, "prediction.content parts"),
        ({"type": "content", "content": "x", "extra": 1}, "unknown field(s): extra"),
    ],
)
def test_bad_predictions_are_400(client, prediction, message):
    response = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "prediction": prediction}
    )
    error = assert_error(response, 400, "prediction")
    assert message in error["message"]


def test_a_prediction_past_the_context_is_400(client, tiny_engine):
    long = "fibonacci " * tiny_engine.context_length
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 4,
            "prediction": {"type": "content", "content": long},
        },
    )
    error = assert_error(response, 400, "prediction")
    assert error["code"] == "context_length_exceeded"
    assert "does not fit" in error["message"]
