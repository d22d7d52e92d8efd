"""Penalties and biases: the rule on synthetic logits, and decoding under them on tiny
random-weight models: exact decoding gives the penalised target's greedy tokens, sampled
speculative decoding draws from the penalised distribution."""

import math

import pytest
import torch

from flyspec.config import ConfigError, DecodeConfig, FlyConfig, SamplingConfig
from flyspec.decoding.drafters import Draft, Drafter
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.penalties import bias_vector, penalised_logits, row_counts
from flyspec.decoding.stats import RequestStats
from flyspec.decoding.verify import sampling_probs
from tests.sampling import binned_distance, token_histogram

VOCAB = 64
PROMPT = [3, 7, 11, 7, 3, 7, 11]


def test_each_row_of_a_block_counts_the_answer_and_the_draft_tokens_before_it():
    answer = torch.tensor([0.0, 2.0, 0.0, 1.0])
    counts = row_counts(answer, torch.tensor([2, 2, 3]))
    expected = torch.tensor(
        [[0, 2, 0, 1], [0, 2, 1, 1], [0, 2, 2, 1], [0, 2, 2, 2]], dtype=torch.float32
    )
    torch.testing.assert_close(counts, expected)
    # A draft token past the target's vocabulary counts nowhere.
    torch.testing.assert_close(row_counts(answer, torch.tensor([7]))[1], answer)


def test_openai_penalties_subtract_the_count_and_the_presence_then_the_bias_adds():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    counts = torch.tensor([[0.0, 3.0, 1.0, 0.0]])
    sampling = SamplingConfig(frequency_penalty=0.5, presence_penalty=0.25)
    bias = bias_vector({3: -100.0, 0: 2.0}, 4)
    got = penalised_logits(logits, counts, sampling=sampling, bias=bias)
    expected = torch.tensor([[3.0, 2.0 - 1.5 - 0.25, -1.0 - 0.5 - 0.25, -math.inf]])  # a ban
    torch.testing.assert_close(got, expected)


def test_the_repetition_penalty_shrinks_what_was_seen_toward_unlikely():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    counts = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    in_prompt = torch.tensor([False, False, False, True])
    got = penalised_logits(
        logits, counts, sampling=SamplingConfig(repetition_penalty=2.0), in_prompt=in_prompt
    )
    torch.testing.assert_close(got, torch.tensor([[1.0, -4.0, 2.0, -4.0]]))


def test_without_penalties_the_logits_are_left_as_they_are():
    logits = torch.randn(3, 5)
    assert penalised_logits(logits, torch.ones(3, 5), sampling=SamplingConfig()) is logits


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ],
)
def test_settings_out_of_range_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=field) as raised:
        SamplingConfig(**settings)
    assert raised.value.field == field


def penalised_greedy(model, prompt, n, sampling):
    """Greedy decoding with full recomputation under ``sampling``'s penalties, as their
    definitions read (no cache, no block): the reference."""
    sequence = list(prompt)
    bias = bias_vector(sampling.logit_bias, VOCAB)
    in_prompt = torch.bincount(torch.tensor(prompt), minlength=VOCAB) > 0
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([sequence])).logits[0, -1:]
            answer = torch.tensor(sequence[len(prompt) :], dtype=torch.long)
            counts = torch.bincount(answer, minlength=VOCAB).float()[None]
            row = penalised_logits(
                logits, counts, sampling=sampling, in_prompt=in_prompt, bias=bias
            )
            sequence.append(int(row.argmax()))
    return sequence[len(prompt) :]


PENALTIES = {
    "frequency": SamplingConfig(frequency_penalty=1.5),
    "presence": SamplingConfig(presence_penalty=2.0),
    "repetition": SamplingConfig(repetition_penalty=1.8),
    "all, with a bias": SamplingConfig(
        frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3, logit_bias=((9, 4.0),)
    ),
}


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("drafter", ["target", "model", "ngram", "mla"])
def test_exact_decoding_gives_the_penalised_targets_greedy_tokens(target, draft, penalty, drafter):
    sampling = PENALTIES[penalty]
    reference = penalised_greedy(target, PROMPT, 30, sampling)
    plain = penalised_greedy(target, PROMPT, 30, SamplingConfig())
    assert reference != plain  # the penalty changes the answer
    mode = "target" if drafter == "target" else "spd"
    config = DecodeConfig(
        mode=mode,
        drafter="model" if drafter == "target" else drafter,
        k=5,
        max_new_tokens=30,
        sampling=sampling,
    )
    decoder = SpeculativeDecoder(target, draft)
    assert [e.token for e in decoder.stream(PROMPT, config)] == reference


def test_a_prediction_and_fly_decode_under_the_penalties(target, draft):
    sampling = PENALTIES["all, with a bias"]
    reference = penalised_greedy(target, PROMPT, 30, sampling)
    decoder = SpeculativeDecoder(target, draft)
    predicted = DecodeConfig(mode="spd", k=8, max_new_tokens=30, sampling=sampling)
    stats = RequestStats()
    events = decoder.stream(PROMPT, predicted, stats=stats, prediction=reference[:20])
    assert [e.token for e in events] == reference
    assert {r.source for r in stats.rounds} >= {"prediction"}
    # FLy keeps some draft tokens loosely, each one the penalised target found plausible.
    fly = DecodeConfig(
        mode="fly", k=5, max_new_tokens=30, sampling=sampling, fly=FlyConfig(theta=0.0, window=1)
    )
    stats = RequestStats()
    list(decoder.stream(PROMPT, fly, stats=stats))
    assert stats.num_rounds > 0


class BannedDrafter(Drafter):
    """Proposes ``banned`` at every position: FLy with no gate and no window would keep any
    mismatch it can."""

    def __init__(self, banned: int) -> None:
        self.banned = banned

    def reset(self) -> None:
        pass

    def propose(self, context, k):
        return Draft(tokens=torch.full((k,), self.banned, dtype=torch.long))


def test_a_bias_of_minus_100_keeps_a_token_out_of_every_method(target, draft):
    plain = penalised_greedy(target, PROMPT, 20, SamplingConfig())
    banned = plain[3]
    sampling = SamplingConfig(logit_bias=((banned, -100.0),))
    decoder = SpeculativeDecoder(target, draft)
    for mode, drafter in (
        ("target", "model"),
        ("spd", "model"),
        ("fly", "model"),
        ("spd", "ngram"),
    ):
        config = DecodeConfig(mode=mode, drafter=drafter, k=4, max_new_tokens=20, sampling=sampling)
        assert banned not in [e.token for e in decoder.stream(PROMPT, config)]
    # FLy with no gate and no window, the draft proposing the banned token everywhere.
    loosest = FlyConfig(theta=0.0, window=0)
    for temperature in (0.0, 1.0):
        sampling = SamplingConfig(temperature=temperature, seed=0, logit_bias=((banned, -100),))
        config = DecodeConfig(mode="fly", k=4, max_new_tokens=20, fly=loosest, sampling=sampling)
        stream = decoder.stream(PROMPT, config, drafter=BannedDrafter(banned))
        assert banned not in [e.token for e in stream]
    # Without the bias the same rule keeps the drafted token.
    config = DecodeConfig(mode="fly", k=4, max_new_tokens=20, fly=loosest)
    kept = [e.token for e in decoder.stream(PROMPT, config, drafter=BannedDrafter(banned))]
    assert banned in kept


def test_sampled_speculative_decoding_draws_the_second_token_from_the_penalised_target(
    target, draft
):
    """The second token's distribution, summed over the first: the first's row sees no
    answer, the second's counts the first, drafted or not. Speculative sampling with a
    sampled draft must reproduce it. (Unpenalised, it is 0.17 away in these bins: the
    penalties move it.)"""
    prompt = [5]
    sampling = SamplingConfig(temperature=0.2, frequency_penalty=2.0, presence_penalty=2.0)
    plain = SamplingConfig(temperature=0.2)
    with torch.inference_mode():
        first_logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
        first = sampling_probs(first_logits, plain).float()
        sequences = torch.tensor([prompt + [t] for t in range(VOCAB)])
        second_logits = target(input_ids=sequences).logits[:, -1]  # [V, V]
    counts = torch.nn.functional.one_hot(torch.arange(VOCAB), VOCAB).float()
    second_rows = sampling_probs(penalised_logits(second_logits, counts, sampling=sampling), plain)
    expected = (first[:, None] * second_rows.float()).sum(dim=0)
    unpenalised = (first[:, None] * sampling_probs(second_logits, plain).float()).sum(dim=0)
    assert binned_distance(unpenalised, expected, bins=6) > 0.15
    decoder = SpeculativeDecoder(target, draft)
    histogram = token_histogram(decoder, prompt, sampling, trials=600, position=1)
    distance = binned_distance(histogram, expected, bins=6)
    assert distance < 0.07, distance
