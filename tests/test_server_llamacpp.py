"""`flyspec serve --backend llamacpp` end to end: the server app on the llama.cpp backend with
the tiny GGUF pair (``tiny_ggufs``), driven by the official openai client, for every drafter,
with a prediction, streamed and not. Exact SPD on these float32 files gives llama.cpp's
greedy text token for token (docs/design.md), so each answer is checked against it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.test_server import openai_client

pytest.importorskip("llama_cpp")

MODEL = "tiny-gguf"
PROMPT = "def fibonacci(n):\n    return"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def client(tiny_llamacpp_engine) -> Iterator[openai.OpenAI]:
    with openai_client(tiny_llamacpp_engine, max_new_tokens=MAX_TOKENS, model=MODEL) as client:
        yield client


def complete(client: openai.OpenAI, *, stream: bool, **extra) -> tuple[str, dict]:
    """The text of one completion, and its ``speculative`` statistics."""
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=stream, extra_body=extra
    )
    if not stream:
        return response.choices[0].text, response.model_extra["speculative"]
    chunks = list(response)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    return text, chunks[-1].model_extra["speculative"]


@pytest.fixture(scope="module")
def greedy(client) -> str:
    text, _ = complete(client, stream=False, mode="target")
    assert text
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("drafter", ["model", "mla", "ngram"])
def test_every_drafter_serves_llamacpps_greedy_text(client, greedy, drafter, stream):
    text, speculative = complete(client, stream=stream, mode="spd", drafter=drafter)
    assert text == greedy
    if drafter != "ngram":  # prompt lookup may find nothing to draft in a short answer
        assert speculative["drafted"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("drafter", ["model", "mla", "ngram"])
def test_fly_runs_with_every_drafter(client, drafter, stream):
    text, speculative = complete(client, stream=stream, mode="fly", drafter=drafter)
    assert text and speculative["mode"] == "fly"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_prediction_drafts_on_llamacpp(client, greedy, drafter, stream):
    edited = greedy[: len(greedy) // 2] + "#" + greedy[len(greedy) // 2 :]
    prediction = {"type": "content", "content": edited}
    text, speculative = complete(
        client, stream=stream, mode="spd", drafter=drafter, prediction=prediction
    )
    assert text == greedy
    assert speculative["drafted"] > 0


def test_usage_counts_the_predicted_tokens(client, greedy):
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        extra_body={
            "mode": "spd",
            "drafter": "model",
            "prediction": {"type": "content", "content": greedy},
        },
    )
    assert response.choices[0].text == greedy
    assert response.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_may_ask_for_k_auto(client, greedy, stream):
    text, _ = complete(client, stream=stream, mode="spd", drafter="model", k="auto")
    assert text == greedy
