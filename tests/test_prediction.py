"""Drafting from a prediction of the answer (Predicted Outputs): alignment, fallback, the
decoder's counts, and losslessness."""

import numpy as np
import pytest
import torch

from flyspec.config import DecodeConfig, FlyConfig
from flyspec.decoding.drafters import Draft, Drafter, PredictionDrafter, make_drafter
from flyspec.decoding.drafters.prediction import SURE_MATCH, find_place
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats
from flyspec.errors import FlyspecError
from tests.tiny import make_tiny_model

PROMPT = [1, 2, 3]


def answer_tokens(length: int, *, start: int = 100) -> list[int]:
    """Distinct tokens, so that every n-gram occurs once."""
    return list(range(start, start + length))


class Recorder(Drafter):
    """A fallback drafter that proposes fixed tokens and records that it was asked."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, context, k):
        self.calls += 1
        return Draft(tokens=torch.tensor([7] * k, dtype=torch.long))

    def reset(self) -> None:
        self.calls = 0


def test_an_answer_that_follows_the_prediction_gets_its_next_tokens():
    prediction = answer_tokens(40)
    drafter = PredictionDrafter(prediction, prompt_length=len(PROMPT))
    assert drafter.propose(PROMPT, 5).tokens.tolist() == prediction[:5]
    draft = drafter.propose(PROMPT + prediction[:12], 5)
    assert draft.tokens.tolist() == prediction[12:17]
    assert draft.source == "prediction"
    assert drafter.plan(PROMPT + prediction[:12]) == "prediction"


def test_the_answer_s_first_block_is_a_kind_of_its_own():
    """Nothing of the answer yet matches the prediction: its start is proposed, as a block of
    kind ``prediction-start`` (``-k auto`` learns apart how often answers open as their
    predictions do); once one token follows it, the run is ``prediction``."""
    prediction = answer_tokens(40)
    drafter = PredictionDrafter(prediction, prompt_length=len(PROMPT))
    assert drafter.plan(PROMPT) == "prediction-start"
    assert drafter.propose(PROMPT, 4).tokens.tolist() == prediction[:4]
    assert drafter.plan(PROMPT + prediction[:1]) == "prediction"
    fenced = PredictionDrafter(prediction, prompt_length=len(PROMPT))
    assert fenced.plan(PROMPT + [900]) == "lookup"  # an answer that opened otherwise


def test_an_answer_that_skips_a_predicted_line_is_found_again_at_once():
    """The answer leaves out the prediction's tokens 20-29 (a deleted line): the first tokens
    after the gap match the prediction after it."""
    prediction = answer_tokens(60)
    answer = prediction[:20] + prediction[30:33]
    drafter = PredictionDrafter(prediction, prompt_length=len(PROMPT))
    drafter.propose(PROMPT + prediction[:20], 8)
    assert drafter.propose(PROMPT + answer, 4).tokens.tolist() == prediction[33:37]


def test_an_inserted_line_is_found_again_within_a_few_tokens():
    """The answer inserts 6 tokens the prediction lacks, then goes on with it: from the
    third token after the insertion on, the drafts are the prediction's again."""
    prediction = answer_tokens(60)
    inserted = answer_tokens(6, start=500)
    answer = prediction[:20] + inserted + prediction[20:]
    drafter = PredictionDrafter(prediction, prompt_length=len(PROMPT), fallback=Recorder())
    found_after = None
    for produced in range(20, len(answer)):
        draft = drafter.propose(PROMPT + answer[:produced], 4)
        if produced >= 26 and draft.source == "prediction":
            assert draft.tokens.tolist() == answer[produced : produced + 4]
            found_after = produced - 26
            break
    assert found_after is not None and found_after <= 3


def test_without_a_place_it_falls_back_to_prompt_lookup_then_to_the_fallback():
    prediction = answer_tokens(30)
    fallback = Recorder()
    drafter = PredictionDrafter(prediction, prompt_length=4, fallback=fallback)
    context = [9, 8, 7, 6, 500, 501, 502, 9, 8, 7]  # the answer's tail recurs in the prompt
    draft = drafter.propose(context, 3)
    assert draft.source == "lookup" and draft.tokens.tolist() == [6, 500, 501]
    assert drafter.plan(context) == "lookup"
    short = [9, 8, 7, 6, 500, 501, 502, 9, 8]  # a tail of two tokens is too short to look up
    assert drafter.plan(short) == "model"
    lost = [9, 8, 7, 6, 600, 601, 602]
    assert drafter.propose(lost, 3).tokens.tolist() == [7, 7, 7]
    assert fallback.calls == 1
    assert drafter.plan(lost) == "model"


def test_past_the_end_of_the_prediction_the_fallback_drafts():
    prediction = answer_tokens(10)
    fallback = Recorder()
    drafter = PredictionDrafter(prediction, prompt_length=len(PROMPT), fallback=fallback)
    assert drafter.propose(PROMPT + prediction[:8], 5).tokens.tolist() == prediction[8:]
    assert drafter.propose(PROMPT + prediction + [900, 901], 3).tokens.tolist() == [7, 7, 7]


def test_a_repeated_line_is_followed_where_the_answer_stands():
    """Two equal stretches in the prediction: the one the answer reached is continued."""
    line = [50, 51, 52, 53]
    prediction = [10, 11, *line, 12, 13, 14, *line, 15, 16]
    answer = [10, 11, *line, 12, 13, 14, *line]
    place = find_place(np.array(prediction), answer, expected=len(answer))
    assert place.index == len(answer) and place.sure
    replaced = [10, 11, *line, 12, 99, 14, 50, 51, 52]
    place = find_place(np.array(prediction), replaced, expected=len(replaced))
    assert place.index == 12 and not place.sure


def test_a_place_found_from_a_long_match_is_sure():
    prediction = np.array(answer_tokens(40))
    answer = [999] + answer_tokens(SURE_MATCH, start=110)
    place = find_place(prediction, answer, expected=3)
    assert place.index == 10 + SURE_MATCH and place.sure


def test_end_tokens_end_a_predicted_block():
    drafter = PredictionDrafter([5, 6, 0, 8], prompt_length=1, end_tokens={0})
    assert drafter.propose([1], 4).tokens.tolist() == [5, 6, 0]


def test_without_a_fallback_a_lost_place_drafts_nothing():
    drafter = PredictionDrafter(answer_tokens(30), prompt_length=2)
    assert len(drafter.propose([1, 2, 600, 601, 602], 4)) == 0


def test_make_drafter_wraps_the_configured_drafter_with_a_prediction():
    config = DecodeConfig(mode="spd", drafter="ngram")
    drafter = make_drafter(config, draft_lm=None, prediction=[4, 5], prompt_length=2)
    assert isinstance(drafter, PredictionDrafter) and drafter.fallback is None
    assert make_drafter(config.with_updates(mode="target"), draft_lm=None, prediction=[4]) is None


# ------------------------------------------------------------------------- in the decoder


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(vocab_size=96, seed=3, num_layers=2)


def greedy(target, prompt, n):
    decoder = SpeculativeDecoder(target)
    return [e.token for e in decoder.stream(prompt, DecodeConfig(mode="target", max_new_tokens=n))]


PROMPT_IDS = [5, 17, 33, 8, 60, 12]


def test_a_prediction_equal_to_the_answer_is_kept_whole(target):
    expected = greedy(target, PROMPT_IDS, 40)
    stats = RequestStats()
    config = DecodeConfig(mode="spd", drafter="ngram", k=8, max_new_tokens=40)
    decoder = SpeculativeDecoder(target)
    tokens = [e.token for e in decoder.stream(PROMPT_IDS, config, stats=stats, prediction=expected)]
    assert tokens == expected
    assert stats.rejected_prediction_tokens == 0
    assert stats.accepted_prediction_tokens == stats.drafted == 40 - stats.num_rounds
    assert {r.source for r in stats.rounds} == {"prediction"}


@pytest.mark.parametrize("mode", ["spd", "fly"])
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_exact_decoding_with_an_edited_prediction_is_the_targets_greedy(target, mode, drafter):
    """A prediction with a line changed, one left out and one added: exact decoding still
    emits the target's greedy tokens; the counts add up."""
    expected = greedy(target, PROMPT_IDS, 60)
    edited = expected[:10] + [1, 2, 3] + expected[13:30] + expected[36:50] + [4, 5, 6, 7]
    config = DecodeConfig(mode=mode, drafter=drafter, k=6, max_new_tokens=60)
    if mode == "fly":
        config = config.with_updates(fly=FlyConfig(theta=float("inf")))
    draft = make_tiny_model(vocab_size=96, seed=4, num_layers=1)
    decoder = SpeculativeDecoder(target, draft)
    stats = RequestStats()
    tokens = [e.token for e in decoder.stream(PROMPT_IDS, config, stats=stats, prediction=edited)]
    assert tokens == expected
    predicted = [r for r in stats.rounds if r.source == "prediction"]
    assert stats.accepted_prediction_tokens == sum(r.accepted for r in predicted) > 30
    assert stats.rejected_prediction_tokens == sum(r.rejected for r in predicted)
    assert stats.as_dict()["accepted_prediction_tokens"] == stats.accepted_prediction_tokens


def test_auto_k_keeps_estimates_per_kind_of_block(target):
    expected = greedy(target, PROMPT_IDS, 30)
    config = DecodeConfig(mode="spd", drafter="ngram", k=8, max_new_tokens=30, auto_k=True)
    decoder = SpeculativeDecoder(target)
    tokens = [e.token for e in decoder.stream(PROMPT_IDS, config, prediction=expected)]
    assert tokens == expected
    kinds = {key[-1] for key in decoder.auto_k.policies}
    assert "prediction" in kinds


def test_a_prediction_may_be_a_tensor_of_token_ids(target):
    """With the draft model behind it: the decoder asks whether a prediction was given, never
    a tensor's truth (ambiguous for more than one element)."""
    expected = greedy(target, PROMPT_IDS, 20)
    decoder = SpeculativeDecoder(target, target)
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=20)
    prediction = torch.tensor(expected, dtype=torch.long)
    tokens = [e.token for e in decoder.stream(PROMPT_IDS, config, prediction=prediction)]
    assert tokens == expected


def test_a_prediction_with_a_drafter_or_empty_is_refused(target):
    decoder = SpeculativeDecoder(target)
    config = DecodeConfig(mode="spd", drafter="ngram")
    with pytest.raises(FlyspecError, match="not both"):
        next(decoder.stream(PROMPT_IDS, config, drafter=Recorder(), prediction=[4]))
    with pytest.raises(FlyspecError, match="empty"):
        next(decoder.stream(PROMPT_IDS, config, prediction=[]))


def test_fly_verifies_predicted_tokens_exactly_unless_told_otherwise(target):
    """A rule that loosens every mismatch (theta 0, no window): drafts from a wrong
    prediction are still verified exactly, unless loosen_predicted is set."""
    expected = greedy(target, PROMPT_IDS, 24)
    wrong = [(token + 1) % 96 for token in expected]
    loose = FlyConfig(theta=0.0, window=0)
    config = DecodeConfig(mode="fly", drafter="ngram", k=6, max_new_tokens=24, fly=loose)
    decoder = SpeculativeDecoder(target)
    tokens = [e.token for e in decoder.stream(PROMPT_IDS, config, prediction=wrong)]
    assert tokens == expected
    loosened = config.with_updates(loosen_predicted=True)
    tokens = [e.token for e in decoder.stream(PROMPT_IDS, loosened, prediction=wrong)]
    assert tokens[:6] == wrong[:6]
