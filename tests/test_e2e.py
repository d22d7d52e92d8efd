"""End to end on the real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B), greedy.

About two to three minutes on 2 CPU cores: the target alone makes ~3 tokens/s.
"""

import gc

import pytest

from flyspec.config import DecodeConfig
from tests.conftest import load_default_engine

pytestmark = pytest.mark.e2e

# Two prompts on which FLy loosens tokens with the default kernels (int8 draft): one alone
# would leave the test to the rounding of one CPU's kernels.
PROMPTS = (
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def results():
    """Each prompt's generation in each mode; the pair is released before the tests run (one
    of them loads its own through the CLI)."""
    engine = load_default_engine()
    generated = [
        {
            mode: engine.generate(
                engine.encode(prompt, chat=True),
                DecodeConfig(mode=mode, max_new_tokens=MAX_NEW_TOKENS),
            )
            for mode in ("target", "spd", "fly")
        }
        for prompt in PROMPTS
    ]
    del engine
    gc.collect()
    return generated


def test_spd_equals_the_target_token_for_token(results):
    for result in results:
        assert len(result["target"].token_ids) == MAX_NEW_TOKENS
        assert result["spd"].token_ids == result["target"].token_ids
        assert result["spd"].stats.loosely_accepted == 0


def test_fly_keeps_mismatches_loosely_and_raises_tau(results):
    assert sum(result["fly"].stats.loosely_accepted for result in results) > 0
    fly_rounds = sum(result["fly"].stats.num_rounds for result in results)
    spd_rounds = sum(result["spd"].stats.num_rounds for result in results)
    assert fly_rounds < spd_rounds  # the same number of tokens in fewer rounds: a higher tau
    assert all("def " in result["fly"].text for result in results)  # still answers


def test_the_library_gives_the_commands_tokens(results, capsys):
    """``Engine.load()`` runs the CLI's kernels (int8 draft, packed Linear layers, lean
    forward): FLy, whose output depends on the draft's numbers, emits the same tokens both ways."""
    import json

    from flyspec.cli import main

    loosened = [
        (prompt, result["fly"])
        for prompt, result in zip(PROMPTS, results, strict=True)
        if result["fly"].stats.loosely_accepted > 0  # the draft's numbers mattered
    ]
    assert loosened
    prompt, fly = loosened[0]
    command = ["generate", "--json", "--chat", prompt, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    command.append("--no-calibration")  # the library's defaults are the paper's rule
    assert main(command) == 0
    gc.collect()  # the command's own copy of the pair
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == fly.token_ids


EDIT_CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""


def test_an_openai_client_with_a_prediction_gets_the_same_text_and_its_counts():
    """Exact decoding on the real pair through the server: a request that sends the code it
    edits as its prediction gets the text of the request without one, with the usage's
    prediction counts filled in."""
    import openai

    from flyspec.server.app import create_app
    from tests.test_server import running

    engine = load_default_engine()
    try:
        app = create_app(
            engine,
            defaults=DecodeConfig(mode="spd", drafter="ngram", max_new_tokens=MAX_NEW_TOKENS),
            model_name="default",
            queue_size=2,
            request_timeout=600,
        )
        request = {
            "model": "default",
            "messages": [
                {
                    "role": "user",
                    "content": f"Add type hints to this function:\n```python\n{EDIT_CODE}```",
                }
            ],
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0,
        }
        with running(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            plain = client.chat.completions.create(**request)
            predicted = client.chat.completions.create(
                **request, prediction={"type": "content", "content": EDIT_CODE}
            )
            streamed = list(
                client.chat.completions.create(
                    **request,
                    prediction={"type": "content", "content": EDIT_CODE},
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
    finally:
        del engine
        gc.collect()
    text = plain.choices[0].message.content
    assert predicted.choices[0].message.content == text
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert streamed[-1].usage.completion_tokens_details == details
