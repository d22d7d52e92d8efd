"""Traces of real rounds, replayed on other models: the recorded counts kept exactly, every
cost paid (the draft model's forwards run for model rounds, none for a prediction's)."""

import pytest

from flyspec.bench.replay import (
    ReplayDecoder,
    Trace,
    TracedRequest,
    TracedRound,
    load_traces,
    save_traces,
    traced_request,
)
from flyspec.config import DecodeConfig, FlyConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats, RoundStats
from flyspec.errors import FlyspecError
from flyspec.testing.host_reads import HostReads
from tests.tiny import make_tiny_model

VOCAB = 64
PROMPT = [3, 7, 11, 7, 3, 7, 11, 5, 9]


@pytest.fixture(scope="module")
def models():
    return {seed: make_tiny_model(vocab_size=VOCAB, seed=seed) for seed in (1, 2, 3, 4)}


def record(target, draft, config, prompt=PROMPT, prediction=None):
    """A real request on ``target`` and ``draft``: its trace and its tokens."""
    stats = RequestStats()
    decoder = SpeculativeDecoder(target, draft)
    tokens = [e.token for e in decoder.stream(prompt, config, stats=stats, prediction=prediction)]
    return traced_request(stats), tokens


def greedy(target, prompt, n):
    config = DecodeConfig(mode="target", max_new_tokens=n)
    return [e.token for e in SpeculativeDecoder(target).stream(prompt, config)]


ROUNDS = (
    TracedRound(4, 4, "model"),
    TracedRound(4, 0, "model"),
    TracedRound(4, 2, "lookup"),
    TracedRound(3, 1, "model"),
    TracedRound(0, 0, None),
    TracedRound(4, 3, "model"),
)


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(mode="spd", k=4),
        DecodeConfig(mode="fly", k=4, fly=FlyConfig(theta=0.0, window=1)),
        DecodeConfig(mode="fly", drafter="mla", k=4),
    ],
    ids=["spd", "fly-loose", "fly-mla"],
)
def test_a_replay_keeps_exactly_the_traced_counts(models, config):
    request = TracedRequest(len(PROMPT), ROUNDS)
    trace = Trace("t", config.mode, config.drafter, False, (request,))
    target, draft = models[3], models[4]
    reference = greedy(target, PROMPT, request.tokens)
    decoder = ReplayDecoder(target, draft)
    stats = RequestStats()
    events = decoder.replay(
        PROMPT,
        request,
        reference,
        config,
        paying=decoder.paying_drafters(trace, config),
        stats=stats,
    )
    tokens = [e.token for e in events]
    assert tokens == reference
    replayed = [(r.drafted, r.accepted, r.loosely_accepted, r.source) for r in stats.rounds]
    assert replayed == [(r.drafted, r.kept, 0, r.source) for r in ROUNDS]
    assert decoder.counts.agreed + decoder.counts.overruled == len(ROUNDS)
    if (
        config.mode == "spd"
    ):  # float64 forwards of any size agree: the real verdicts are the trace's
        assert decoder.counts.overruled == 0
    assert decoder.draft.forward_calls > 0  # model rounds paid for the draft's forwards


def test_a_recorded_request_is_its_rounds(models):
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=23)
    request, tokens = record(models[1], models[1], config)  # the target drafting for itself
    assert request.prompt_tokens == len(PROMPT) and request.tokens == len(tokens) == 23
    assert [(r.drafted, r.kept) for r in request.rounds] == [(4, 4)] * 4 + [(2, 2)]
    assert {r.source for r in request.rounds} == {"model"}


def test_the_replay_of_a_prediction_runs_no_draft_model(models):
    target = models[1]
    answer = greedy(target, PROMPT, 30)
    prediction = answer[:12] + [1, 2, 3] + answer[12:]  # an edit: three tokens inserted
    config = DecodeConfig(mode="spd", drafter="ngram", k=8, max_new_tokens=30)
    request, tokens = record(target, None, config, prediction=prediction)
    assert tokens == answer
    assert {r.source for r in request.rounds} >= {"prediction"}
    trace = Trace("predict@8", "spd", "ngram", True, (request,))
    other = models[3]
    decoder = ReplayDecoder(other, models[4])
    reference = greedy(other, PROMPT, request.tokens)
    stats = RequestStats()
    paying = decoder.paying_drafters(trace, config)
    with HostReads() as reads:
        list(decoder.replay(PROMPT, request, reference, config, paying=paying, stats=stats))
    assert [r.accepted for r in stats.rounds] == [r.kept for r in request.rounds]
    assert decoder.draft.forward_calls == 0
    # As a real prediction's rounds: one read each, and the blocks made on the device from
    # the reference copied there once, beside the prompt; a verdict overruled (rounding) is
    # the trace's, whose tokens the device does not hold: they are copied from the host.
    assert reads.count == stats.num_rounds
    assert reads.from_host == 2 + decoder.counts.overruled


def test_verdicts_the_target_disagrees_with_are_overruled(models):
    # A reference the target would not decode (another model's): the trace's counts anyway.
    request = TracedRequest(len(PROMPT), ROUNDS)
    trace = Trace("spd@4", "spd", "model", False, (request,))
    config = DecodeConfig(mode="spd", k=4)
    decoder = ReplayDecoder(models[1], models[2])
    reference = greedy(models[3], PROMPT, request.tokens)
    stats = RequestStats()
    paying = decoder.paying_drafters(trace, config)
    tokens = [
        e.token
        for e in decoder.replay(PROMPT, request, reference, config, paying=paying, stats=stats)
    ]
    assert tokens == reference
    assert [r.accepted for r in stats.rounds] == [r.kept for r in ROUNDS]
    assert decoder.counts.overruled > 0


def test_traces_round_trip_through_their_file(tmp_path):
    requests = (
        TracedRequest(12, (TracedRound(8, 3, "model"), TracedRound(0, 0, None))),
        TracedRequest(5, (TracedRound(15, 15, "prediction"), TracedRound(4, 1, "lookup"))),
    )
    trace = Trace("fly@8", "fly", "model", False, requests)
    assert trace.tau == pytest.approx((4 + 1 + 16 + 2) / 4)
    save_traces(tmp_path / "t.json", [trace], recorded={"commit": "abc"})
    recorded, loaded = load_traces(tmp_path / "t.json")
    assert recorded == {"commit": "abc"} and loaded == [trace]


def test_bad_traces_and_references_are_refused_in_a_line(models, tmp_path):
    with pytest.raises(FlyspecError, match="keeps 0 to 4 tokens"):
        TracedRound(4, 5, "model")
    with pytest.raises(FlyspecError, match="unknown draft source"):
        TracedRound(4, 1, "oracle")
    (tmp_path / "bad.json").write_text('{"format": 1, "traces": [{"name": "x"}]}')
    with pytest.raises(FlyspecError, match="not a trace"):
        load_traces(tmp_path / "bad.json")
    request = TracedRequest(len(PROMPT), (TracedRound(4, 2, "model"),))
    trace = Trace("t", "spd", "model", False, (request,))
    with pytest.raises(FlyspecError, match="give a draft model"):
        ReplayDecoder(models[1]).paying_drafters(trace, DecodeConfig(mode="spd"))
    decoder = ReplayDecoder(models[1], models[2])
    paying = decoder.paying_drafters(trace, DecodeConfig(mode="spd"))
    with pytest.raises(FlyspecError, match="reference holds 1 tokens"):
        list(decoder.replay(PROMPT, request, [1], DecodeConfig(mode="spd"), paying=paying))


def test_deferred_windows_are_not_traced():
    stats = RequestStats(prompt_tokens=3)
    deferring = RoundStats(4, 3, 0, 3, 0.0, 0.0, deferred=True, source="model")
    stats.rounds += [RoundStats(4, 1, 0, 2, 0.0, 0.0, source="model"), deferring]
    with pytest.raises(FlyspecError, match="deferred windows"):
        traced_request(stats)
