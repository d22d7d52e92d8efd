"""Log-probabilities of emitted tokens: each the target's, at its position, under the
distribution verification read, whatever kept the token (exact, loose, deferred, a
prediction); and through the server, as OpenAI's clients read them."""

from __future__ import annotations

import pytest
import torch

from flyspec.config import DecodeConfig, FlyConfig, SamplingConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.penalties import penalised_logits
from flyspec.decoding.stats import RequestStats
from flyspec.decoding.verify import sampling_logits
from flyspec.errors import FlyspecError
from tests.tiny import near_copy

VOCAB = 64
PROMPT = [5]


def reference_logprobs(model, prompt, tokens, sampling):
    """Each token's log-probability from one forward over the whole sequence: the row of its
    position, penalised for the answer before it, after temperature above 0."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    answer = torch.tensor(tokens)
    before = (
        torch.nn.functional.one_hot(answer, VOCAB).float().cumsum(0)
        - torch.nn.functional.one_hot(answer, VOCAB).float()
    )
    rows = penalised_logits(logits, before, sampling=sampling)
    if not sampling.greedy:
        rows = sampling_logits(rows, sampling)
    return rows.float().log_softmax(dim=-1)  # [n, V]


CASES = {
    "target alone": DecodeConfig(mode="target"),
    "exact": DecodeConfig(mode="spd", k=6),
    "fly, loose": DecodeConfig(mode="fly", k=6, fly=FlyConfig(theta=0.0, window=1)),
    "fly, deferred": DecodeConfig(mode="fly", k=6, fly=FlyConfig(theta=0.0, window=2, defer=True)),
    "penalised": DecodeConfig(
        mode="spd", k=6, sampling=SamplingConfig(frequency_penalty=1.0, presence_penalty=0.5)
    ),
    "sampled": DecodeConfig(mode="fly", k=6, sampling=SamplingConfig(temperature=0.8, seed=3)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_token_has_the_targets_logprob_at_its_position(target, case):
    config = CASES[case].with_updates(max_new_tokens=40)
    decoder = SpeculativeDecoder(target, near_copy(target, 0.1))
    stats = RequestStats()
    events = list(decoder.stream(PROMPT, config, stats=stats, logprobs=3))
    tokens = [event.token for event in events]
    expected = reference_logprobs(target, PROMPT, tokens, config.sampling)
    for position, event in enumerate(events):
        row = expected[position]
        assert event.logprob.logprob == pytest.approx(float(row[event.token]), abs=1e-5)
        top = row.topk(3)
        assert [token for token, _ in event.logprob.top] == top.indices.tolist()
        assert [value for _, value in event.logprob.top] == pytest.approx(
            top.values.tolist(), abs=1e-5
        )
    origins = {event.origin for event in events}
    if case.startswith("fly"):
        assert "loose" in origins
    if case == "fly, deferred":
        assert stats.deferrals("confirmed") > 0 and stats.deferrals("rolled_back") > 0


def test_a_prediction_s_tokens_have_their_logprobs_too(target, draft):
    plain = DecodeConfig(mode="target", max_new_tokens=30)
    answer = [e.token for e in SpeculativeDecoder(target).stream(PROMPT, plain)]
    config = DecodeConfig(mode="spd", k=8, max_new_tokens=30)
    decoder = SpeculativeDecoder(target, draft)
    events = list(decoder.stream(PROMPT, config, prediction=answer[:10] + answer[13:], logprobs=0))
    assert [e.token for e in events] == answer
    expected = reference_logprobs(target, PROMPT, answer, config.sampling)
    for position, event in enumerate(events):
        assert event.logprob.top == ()
        assert event.logprob.logprob == pytest.approx(
            float(expected[position, event.token]), abs=1e-5
        )


def test_without_logprobs_nothing_is_computed_and_out_of_range_is_refused(target, draft):
    decoder = SpeculativeDecoder(target, draft)
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=8)
    assert all(e.logprob is None for e in decoder.stream(PROMPT, config))
    with pytest.raises(FlyspecError, match="logprobs must be in"):
        list(decoder.stream(PROMPT, config, logprobs=21))


@pytest.mark.parametrize("rows", [256, 3])
def test_a_prompts_logprobs_are_the_targets_after_the_tokens_before(target, monkeypatch, rows):
    """One forward's worth of rows at a time (3: the prompt in several pieces), each token
    scored by the logits at the position before it."""
    monkeypatch.setattr("flyspec.decoding.loop.PROMPT_LOGPROB_ROWS", rows)
    prompt = [5, 9, 2, 33, 7, 7, 12, 40]
    decoder = SpeculativeDecoder(target)
    records = decoder.prompt_logprobs(prompt, top=3)
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt])).logits[0].double()
    expected = logits.log_softmax(dim=-1)
    assert records[0] is None and len(records) == len(prompt)
    for position, record in enumerate(records[1:], start=1):
        row = expected[position - 1]
        assert record.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-5)
        assert [token for token, _ in record.top] == row.topk(3).indices.tolist()
    # The decoder goes on as before: a request after it gives the target's greedy tokens.
    config = DecodeConfig(mode="target", max_new_tokens=5)
    assert [e.token for e in decoder.stream(prompt, config)] == [
        e.token for e in SpeculativeDecoder(target).stream(prompt, config)
    ]
