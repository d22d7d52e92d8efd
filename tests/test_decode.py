"""The decoding loop on tiny random-weight models: losslessness, caches, limits, statistics."""

import copy
import math
from pathlib import Path

import pytest
import torch

from flyspec.config import (
    FORWARD_PATHS,
    MIN_TEMPERATURE,
    DecodeConfig,
    FlyConfig,
    SamplingConfig,
)
from flyspec.decoding.drafters import Draft, Drafter, MlaDrafter, ModelDrafter, NgramDrafter
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats
from flyspec.decoding.verify import sampling_probs
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM, common_prefix_length
from flyspec.testing.host_reads import HostReads
from tests.sampling import binned_distance, token_histogram
from tests.tiny import near_copy

VOCAB = 64
PROMPTS = [[3, 7, 11, 7, 3, 7, 11], [5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3]]


def run(decoder, prompt, config, stats=None):
    return [event.token for event in decoder.stream(prompt, config, stats=stats)]


def target_greedy(target, prompt, max_new_tokens):
    decoder = SpeculativeDecoder(target)
    return run(decoder, prompt, DecodeConfig(mode="target", max_new_tokens=max_new_tokens))


def reference_greedy(model, prompt, max_new_tokens):
    """Plain greedy decoding with full recomputation: no cache involved."""
    sequence = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
    return sequence[len(prompt) :]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_mode_equals_plain_greedy_decoding(target, prompt):
    assert target_greedy(target, prompt, 24) == reference_greedy(target, prompt, 24)


@pytest.mark.parametrize("drafter", ["model", "ngram", "mla"])
@pytest.mark.parametrize("k", [1, 4, 15])
def test_spd_equals_target(target, draft, drafter, k):
    decoder = SpeculativeDecoder(target, draft)
    config = DecodeConfig(mode="spd", drafter=drafter, k=k, max_new_tokens=40)
    for prompt in PROMPTS:
        assert run(decoder, prompt, config) == target_greedy(target, prompt, 40)


@pytest.mark.parametrize("auto_k", [False, True])
def test_a_first_token_alone_comes_from_one_round_of_the_target_and_changes_no_token(
    target, draft, auto_k
):
    decoder = SpeculativeDecoder(target, draft)
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=20, auto_k=auto_k)
    alone = config.with_updates(first_token_alone=True)
    for prompt in PROMPTS:
        stats = RequestStats()
        events = list(decoder.stream(prompt, alone, stats=stats))
        assert [event.token for event in events] == target_greedy(target, prompt, 20)
        first = stats.rounds[0]
        assert (first.drafted, first.emitted) == (0, 1)
        assert events[0].round_index == 0 and events[1].round_index == 1
    stats = RequestStats()
    run(decoder, PROMPTS[0], config.with_updates(auto_k=False), stats)
    assert stats.rounds[0].drafted == 4  # without it, the first round drafts


def test_spd_with_the_target_as_its_own_draft_accepts_everything(target):
    decoder = SpeculativeDecoder(target, target)
    stats = RequestStats()
    tokens = run(decoder, PROMPTS[0], DecodeConfig(mode="spd", k=4, max_new_tokens=20), stats)
    assert tokens == target_greedy(target, PROMPTS[0], 20)
    assert stats.rejected == 0 and stats.loosely_accepted == 0
    assert stats.num_rounds == 4  # 5 tokens per round: 4 drafted + the bonus


def test_fly_with_infinite_theta_equals_target(target, draft):
    decoder = SpeculativeDecoder(target, draft)
    config = DecodeConfig(mode="fly", fly=FlyConfig(theta=math.inf), max_new_tokens=40)
    for prompt in PROMPTS:
        assert run(decoder, prompt, config) == target_greedy(target, prompt, 40)


@pytest.fixture(scope="module")
def close_draft(target):
    """A draft that mostly agrees with the target: the target with noise on its output layer."""
    model = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight.add_(
            0.5 * weight.std() * torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
        )
    return model


def test_fly_accepts_loosely_on_uncertain_random_models(target, close_draft):
    decoder = SpeculativeDecoder(target, close_draft)
    stats = RequestStats()
    config = DecodeConfig(mode="fly", k=8, fly=FlyConfig(window=1, theta=0.0), max_new_tokens=40)
    tokens = run(decoder, PROMPTS[0], config, stats)
    assert len(tokens) == 40
    assert stats.loosely_accepted > 0


@pytest.mark.parametrize("mode", ["spd", "fly"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 16])
def test_never_emits_past_max_new_tokens(target, draft, mode, max_new_tokens):
    decoder = SpeculativeDecoder(target, draft)
    stats = RequestStats()
    config = DecodeConfig(
        mode=mode, k=15, fly=FlyConfig(window=0, theta=0.0), max_new_tokens=max_new_tokens
    )
    tokens = run(decoder, PROMPTS[0], config, stats)
    assert len(tokens) == max_new_tokens == stats.emitted
    assert stats.finish_reason == "length"


def test_eos_inside_a_block_ends_the_request_before_it(target):
    expected = target_greedy(target, PROMPTS[2], 30)
    eos = expected[9]
    stop_at = expected.index(eos)
    decoder = SpeculativeDecoder(target, target, eos_token_ids={eos})
    stats = RequestStats()
    tokens = run(decoder, PROMPTS[2], DecodeConfig(mode="spd", k=6, max_new_tokens=30), stats)
    assert tokens == expected[:stop_at]
    assert stats.finish_reason == "stop"
    assert stats.emitted == stop_at
    assert stats.rounds[-1].ended_by_eos
    # tau counts the end-of-sequence token the last round committed.
    assert stats.tau == pytest.approx((stop_at + 1) / stats.num_rounds)
    assert stats.as_dict()["committed"] == stop_at + 1
    # The draft ends its block at the end token: nothing past it is drafted or verified.
    assert stats.drafted <= stop_at + 1


def test_statistics_add_up(target, draft):
    decoder = SpeculativeDecoder(target, draft)
    stats = RequestStats()
    config = DecodeConfig(mode="fly", k=6, fly=FlyConfig(window=1, theta=0.0), max_new_tokens=30)
    tokens = run(decoder, PROMPTS[0], config, stats)
    assert stats.emitted == len(tokens)
    assert stats.accepted + stats.loosely_accepted + stats.rejected == stats.drafted
    assert stats.tau == pytest.approx(len(tokens) / stats.num_rounds)
    assert stats.seconds >= stats.draft_seconds + stats.verify_seconds
    summary = stats.as_dict()
    for name in ("rounds", "drafted", "accepted", "loosely_accepted", "rejected", "emitted"):
        assert isinstance(summary[name], int)


def test_stopping_early_counts_only_delivered_tokens(target, draft):
    decoder = SpeculativeDecoder(target, target)
    stats = RequestStats()
    events = decoder.stream(
        PROMPTS[0], DecodeConfig(mode="spd", k=8, max_new_tokens=30), stats=stats
    )
    received = [next(events).token for _ in range(3)]
    events.close()
    assert len(received) == 3 and stats.emitted == 3
    assert stats.finish_reason == "cancelled"


def test_sampling_is_reproducible_with_a_seed(target, draft):
    decoder = SpeculativeDecoder(target, draft)
    config = DecodeConfig(
        mode="fly",
        k=4,
        max_new_tokens=20,
        draft_temperature=1.0,
        sampling=SamplingConfig(temperature=1.0, seed=7),
    )
    first = run(decoder, PROMPTS[0], config)
    assert first == run(decoder, PROMPTS[0], config)
    assert len(first) == 20


@pytest.mark.parametrize("exponent", [-320, -300, -200, -100, -45, -40, -20, -10, -6])
def test_temperatures_too_small_to_divide_by_are_greedy(target, draft, exponent):
    """Across the float range down to subnormals, a positive temperature below
    MIN_TEMPERATURE decodes exactly as temperature 0 does, in every mode."""
    temperature = 10.0**exponent
    assert 0 < temperature < MIN_TEMPERATURE
    decoder = SpeculativeDecoder(target, draft)
    for mode in ("target", "spd", "fly"):
        greedy = DecodeConfig(mode=mode, k=4, max_new_tokens=12)
        tiny = greedy.with_updates(
            sampling=SamplingConfig(temperature=temperature, seed=3),
            draft_temperature=temperature,
        )
        assert tiny.sampling.greedy and tiny.draft_temperature == 0
        assert run(decoder, PROMPTS[0], tiny) == run(decoder, PROMPTS[0], greedy)


def test_smallest_sampled_temperature_stays_finite(target):
    logits = target(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float() * 100
    probs = sampling_probs(logits, SamplingConfig(temperature=MIN_TEMPERATURE))
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)


def test_speculative_sampling_keeps_the_targets_distribution(target, draft):
    """Histogram of the first token of spd with a sampled draft vs the target's exact
    distribution (temperature 0.5 keeps it peaked enough for a few hundred samples)."""
    decoder = SpeculativeDecoder(target, draft)
    prompt = [5, 9]
    sampling = SamplingConfig(temperature=0.5)
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
    expected = sampling_probs(logits, sampling).float()
    histogram = token_histogram(decoder, prompt, sampling, trials=400)
    # Five bins (the target's four likeliest tokens and the rest) keep sampling noise small:
    # a mean total variation of about 0.03 for 400 draws.
    assert binned_distance(histogram, expected, bins=5) < 0.07


@pytest.mark.parametrize("forward_path", FORWARD_PATHS)
def test_cropped_cache_gives_the_logits_of_a_fresh_forward(target, forward_path):
    lm = CachedLM(target, forward_path=forward_path)
    assert lm.forward_path == ("lean" if forward_path == "auto" else forward_path)  # off CUDA
    sequence = [3, 9, 27, 17, 51, 25, 11, 33, 5, 15]
    lm.logits(sequence, num_logits=len(sequence))
    # A different continuation after position 6: the cache must drop positions 6..9.
    changed = sequence[:6] + [1, 2]
    cached = lm.logits(changed, num_logits=2)
    assert lm.runner.length == len(changed)
    fresh = CachedLM(target, forward_path=forward_path).logits(changed, num_logits=2)
    torch.testing.assert_close(cached, fresh)


def test_a_prefill_runs_a_forward_only_over_what_the_cache_lacks(target):
    lm = CachedLM(target)
    lm.prefill([3, 9, 27, 17, 51])
    assert (lm.forward_calls, lm.cached_tokens) == (1, [3, 9, 27, 17, 51])
    lm.prefill([3, 9, 27, 17])  # held already: cropped, no forward
    assert (lm.forward_calls, lm.cached_tokens) == (1, [3, 9, 27, 17])
    continued = lm.logits([3, 9, 27, 17, 8], num_logits=2)
    fresh = CachedLM(target).logits([3, 9, 27, 17, 8], num_logits=2)
    torch.testing.assert_close(continued, fresh)
    lm.prefill([3, 9, 1])  # differs from position 2: a forward over the rest
    assert (lm.forward_calls, lm.cached_tokens) == (3, [3, 9, 1])


def test_a_request_that_repeats_a_cached_prompt_reads_only_its_last_token(target, draft):
    decoder = SpeculativeDecoder(target, draft, reuse_prefix=True)
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=8, first_token_alone=True)
    first = run(decoder, PROMPTS[0], config)
    calls = decoder.target.forward_calls
    assert run(decoder, PROMPTS[0], config) == first
    rounds_of_the_second = decoder.target.forward_calls - calls
    stats = RequestStats()
    run(decoder, PROMPTS[0], config, stats)
    assert rounds_of_the_second == len(stats.rounds)  # no forward before the first round
    assert decoder.target.runner.length >= len(PROMPTS[0])


@pytest.mark.parametrize("forward_path", FORWARD_PATHS)
def test_crop_refuses_to_grow(target, forward_path):
    lm = CachedLM(target, forward_path=forward_path)
    lm.logits([1, 2, 3])
    with pytest.raises(ValueError, match="cannot crop"):
        lm.runner.crop(5)
    lm.runner.crop(1)
    assert lm.runner.length == 1
    assert lm.cached_tokens == [1]


@pytest.mark.parametrize("forward_path", FORWARD_PATHS)
def test_both_forward_paths_are_lossless(target, draft, forward_path):
    prompt = PROMPTS[0]
    decoder = SpeculativeDecoder(target, draft, forward_path=forward_path)
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=24)
    assert run(decoder, prompt, config) == reference_greedy(target, prompt, 24)


@pytest.mark.parametrize("forward_path", FORWARD_PATHS)
def test_steps_continue_the_cache_and_are_recorded_unread(draft, forward_path):
    lm = CachedLM(draft, forward_path=forward_path)
    sequence = [3, 9, 27, 17, 51]
    lm.logits(sequence[:2])
    # The first step of a compiled forward reads its check against the eager one: once.
    stepped = [lm.step(torch.tensor([sequence[2]]))]
    with HostReads() as reads:
        stepped += [lm.step(torch.tensor([token])) for token in sequence[3:]]
    assert reads.count == 0
    assert lm.cached_tokens == sequence
    fresh = CachedLM(draft, forward_path=forward_path).logits(sequence, num_logits=3)
    torch.testing.assert_close(torch.stack(stepped), fresh)
    assert lm.logits(sequence[:3] + [1], num_logits=1).shape == (1, VOCAB)  # crops past step 1
    assert lm.cached_tokens == sequence[:3] + [1]
    with pytest.raises(ValueError, match="call logits"):
        CachedLM(draft, forward_path=forward_path).step(torch.tensor([1]))


def test_recorded_steps_need_no_read_and_must_match_the_steps(draft):
    lm = CachedLM(draft)
    lm.logits([3, 9])
    for token in (27, 17):
        lm.step(torch.tensor([token]))
    with pytest.raises(ValueError, match="2 stepped tokens are unread, 1 given"):
        lm.record_steps([27])
    lm.record_steps([27, 17])
    with HostReads() as reads:
        assert lm.cached_tokens == [3, 9, 27, 17]
    assert reads.count == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_model_drafter_reads_the_device_a_fixed_number_of_times_per_block(draft, temperature):
    context = [4, 8, 15, 16, 23, 42]
    counts = []
    for k in (2, 12):
        drafter = ModelDrafter(
            CachedLM(draft), temperature=temperature, generator=torch.Generator().manual_seed(0)
        )
        first = drafter.propose(context, k)
        if first.unread:  # the decoder reads it with its verdict and settles the record
            first.settled(first.tokens.tolist(), k)
        with HostReads() as reads:
            block = drafter.propose(context + [1], k)
        assert len(block) == k and block.unread == (temperature == 0)
        counts.append(reads.count)
    # Greedy: none, the block is read with the verdict; sampled: the block, whose ids also
    # settle the cache's record of its steps.
    assert counts == [0, 0] if temperature == 0 else counts == [1, 1]


def test_the_model_drafter_steps_past_an_end_token_and_the_block_is_cut_there(draft):
    context = [4, 8, 15, 16, 23, 42]
    plain = ModelDrafter(CachedLM(draft)).propose(context, 12).tokens.tolist()
    end_at = next(i for i in range(1, 10) if plain[i] not in plain[:i])
    drafter = ModelDrafter(CachedLM(draft), end_tokens={plain[end_at]})
    greedy = drafter.propose(context, 12)
    assert greedy.unread and greedy.tokens.tolist() == plain  # the verdict cuts it
    assert drafter.lm.forward_calls == 12  # the steps after it were spent
    # Read as it drafts (min_confidence): the block ends at the end token, no step past it.
    reading = ModelDrafter(CachedLM(draft), end_tokens={plain[end_at]}, min_confidence=1e-12)
    assert reading.propose(context, 12).tokens.tolist() == plain[: end_at + 1]


def test_an_unread_block_gives_the_tokens_and_rounds_of_a_block_read_and_cut_at_once(draft):
    # The draft model's own block ends at an end token of the draft's: the decoder cuts the
    # unread block there as the drafter cut the read one (min_confidence makes it read).
    prompt = PROMPTS[0]
    plain = ModelDrafter(CachedLM(draft)).propose(prompt, 12).tokens.tolist()
    end = next(plain[i] for i in range(2, 10) if plain[i] not in plain[:i])
    decoder = SpeculativeDecoder(draft, copy.deepcopy(draft), eos_token_ids={end})
    outputs = {}
    for label, confidence in (("unread", 0.0), ("read", 1e-12)):
        for mode, fly in (("spd", FlyConfig()), ("fly", FlyConfig(theta=0.0, window=1))):
            config = DecodeConfig(
                mode=mode, k=12, max_new_tokens=30, fly=fly, draft_confidence=confidence
            )
            stats = RequestStats()
            tokens = run(decoder, prompt, config, stats)
            rounds = [(r.drafted, r.accepted, r.loosely_accepted, r.emitted) for r in stats.rounds]
            outputs[label, mode] = (tokens, rounds, stats.finish_reason)
    for mode in ("spd", "fly"):
        assert outputs["unread", mode] == outputs["read", mode]
        assert outputs["unread", mode][2] == "stop"


def test_a_round_reads_the_device_as_often_whatever_its_block_size(target):
    """The target drafting for itself keeps every block: the reads per round of the whole
    loop (drafting, verification, commit) do not grow with K."""
    per_round = {}
    for k in (3, 9):
        decoder = SpeculativeDecoder(target, copy.deepcopy(target))
        stats = RequestStats()
        with HostReads() as reads:
            run(
                decoder,
                PROMPTS[0],
                DecodeConfig(mode="spd", k=k, max_new_tokens=4 * (k + 1)),
                stats,
            )
        assert stats.num_rounds == 4
        per_round[k] = reads.count / stats.num_rounds
    # One read: the verdict, with the block's ids.
    assert per_round[3] == per_round[9] == 1, per_round


ROUND_KINDS = {  # kind: (config, prediction, tensors made from host values per request)
    "exact": (DecodeConfig(mode="spd", k=6), False, 1),
    "fly": (DecodeConfig(mode="fly", k=6, fly=FlyConfig(theta=0.0, window=1)), False, 1),
    "fly deferred": (
        DecodeConfig(mode="fly", k=6, fly=FlyConfig(theta=0.0, window=2, defer=True)),
        False,
        1,
    ),
    "prediction": (DecodeConfig(mode="spd", k=6), True, 2),
    "lookup": (DecodeConfig(mode="spd", k=6, drafter="ngram"), False, 1),
}


@pytest.mark.parametrize("kind", ROUND_KINDS)
def test_every_kind_of_round_reads_the_device_once_and_copies_nothing_from_the_host(target, kind):
    """Greedy, each round reads the device once (its verdict, with the draft's ids and what
    FLy thought of each position), whatever it keeps: loose tokens, a deferral confirmed or
    rolled back. The forwards' inputs and the blocks of a prediction or of prompt lookup are
    cut from the context on the device: the only tensors made from host values are the
    prompt's (and the prediction's), once a request."""
    config, predicted, copies = ROUND_KINDS[kind]
    config = config.with_updates(max_new_tokens=40)
    prompt = [5]
    reference = target_greedy(target, prompt, 40)
    prediction = reference[:12] + [9, 9, 9] + reference[12:] if predicted else None
    decoder = SpeculativeDecoder(target, near_copy(target, 0.1))
    run(decoder, prompt, config)  # the first forwards of a compiled path check themselves
    stats = RequestStats()
    with HostReads() as reads:
        tokens = [
            e.token for e in decoder.stream(prompt, config, stats=stats, prediction=prediction)
        ]
    assert reads.count == stats.num_rounds, (reads.count, stats.num_rounds)
    assert reads.from_host == copies
    if kind.startswith("fly"):
        assert sum(r.loosely_accepted for r in stats.rounds) > 0
        if kind == "fly deferred":
            assert stats.deferrals("confirmed") > 0 and stats.deferrals("rolled_back") > 0
    else:
        assert tokens == reference
    if kind in ("prediction", "lookup"):
        assert {r.source for r in stats.rounds} >= {kind}


def test_the_context_on_the_device_is_the_context_after_every_round(target):
    """What the forwards read from the device is what the host committed, round by round,
    through loose tokens and deferrals confirmed and rolled back."""
    config = DecodeConfig(
        mode="fly", k=6, max_new_tokens=40, fly=FlyConfig(theta=0.0, window=2, defer=True)
    )
    decoder = SpeculativeDecoder(target, near_copy(target, 0.1))
    stats = RequestStats()
    emitted = []
    for event in decoder.stream([5], config, stats=stats):
        emitted.append(event.token)
        source = decoder.target.source
        assert source.span(0, len(source)).tolist() == source.ids
        assert source.ids[: 1 + len(emitted)] == [5, *emitted]
    assert stats.deferrals("confirmed") > 0 and stats.deferrals("rolled_back") > 0


@pytest.mark.parametrize("stop_after", [None, 9, 17])
def test_rounds_are_final_once_committed_and_add_up_to_what_was_emitted(target, stop_after):
    """With deferrals confirmed and rolled back, and a caller that stops early: no round's
    statistics change after they are recorded, and the totals are those of the tokens the
    caller received (each exact, loose, correction or bonus as its origin says), tau those
    of the rounds."""
    config = DecodeConfig(
        mode="fly", k=6, max_new_tokens=40, fly=FlyConfig(theta=0.0, window=2, defer=True)
    )
    decoder = SpeculativeDecoder(target, near_copy(target, 0.1))
    stats = RequestStats()
    events, seen = [], []
    stream = decoder.stream([5], config, stats=stats)
    for event in stream:
        events.append(event)
        seen.append(list(stats.rounds))
        if len(events) == stop_after:
            stream.close()
            break
    for earlier in seen:  # the same objects, in the same places
        assert all(a is b for a, b in zip(earlier, stats.rounds, strict=False))
    assert stats.decisions, "no deferral was decided: the case is not covered"
    origins = [event.origin for event in events]
    assert stats.emitted == len(events)
    assert stats.accepted == origins.count("exact")
    assert stats.loosely_accepted == origins.count("loose") == len(stats.loose_tokens)
    assert stats.accepted + stats.loosely_accepted + stats.rejected == stats.drafted
    ended = stats.finish_reason == "stop"
    assert stats.tau == pytest.approx((len(events) + ended) / stats.num_rounds)
    assert stats.finish_reason == ("cancelled" if stop_after else stats.finish_reason)


def test_mla_block_equals_the_draft_models_greedy_block(draft):
    # A context that repeats itself, so that n-gram proposals exist.
    base = reference_greedy(draft, [4, 8, 15], 20)
    context = [4, 8, 15] + base + [4, 8, 15] + base[:5]
    plain = ModelDrafter(CachedLM(draft)).propose(context, 15)
    mla_drafter = MlaDrafter(CachedLM(draft), proposals=6)
    block = mla_drafter.propose(context, 15)
    assert block.tokens.tolist() == plain.tokens.tolist()
    assert mla_drafter.lm.forward_calls < 15  # n-gram proposals kept: several tokens a forward


def test_mla_without_any_ngram_takes_plain_steps(draft):
    context = [1, 2, 3]  # nothing repeats
    mla_drafter = MlaDrafter(CachedLM(draft), proposals=6)
    block = mla_drafter.propose(context, 1)
    assert (
        block.tokens.tolist() == ModelDrafter(CachedLM(draft)).propose(context, 1).tokens.tolist()
    )
    assert mla_drafter.lm.forward_calls == 1


@pytest.mark.parametrize("drafter_class", [ModelDrafter, MlaDrafter])
def test_a_draft_block_ends_at_an_end_token(draft, drafter_class):
    base = reference_greedy(draft, [4, 8, 15], 20)
    context = [4, 8, 15] + base + [4, 8, 15] + base[:5]  # repeats: MLA has proposals
    plain = ModelDrafter(CachedLM(draft)).propose(context, 15).tokens.tolist()
    end_at = next(i for i in range(2, 14) if plain[i] not in plain[:i])
    drafter = drafter_class(CachedLM(draft), end_tokens={plain[end_at]})
    block = drafter.propose(context, 15)
    if block.unread:  # the model drafter's greedy block: the verdict cuts it (tested above)
        block = SpeculativeDecoder(draft, eos_token_ids={plain[end_at]})._read(block)
    assert block.tokens.tolist() == plain[: end_at + 1]


def test_an_ngram_block_ends_at_an_end_token():
    context = [1, 2, 3, 9, 4, 5, 6, 1, 2, 3]
    assert NgramDrafter().propose(context, 5).tokens.tolist() == [9, 4, 5, 6, 1]
    assert NgramDrafter(end_tokens={4}).propose(context, 5).tokens.tolist() == [9, 4]


def draft_probabilities(model, context, block):
    """The draft model's probability (temperature 1) of each token of ``block``."""
    sequence = torch.tensor([list(context) + list(block)])
    with torch.inference_mode():
        logits = model(input_ids=sequence).logits[0, len(context) - 1 : -1]
    return torch.softmax(logits, dim=-1).gather(-1, torch.tensor(block)[:, None])[:, 0]


@pytest.mark.parametrize("drafter_class", [ModelDrafter, MlaDrafter])
def test_draft_confidence_ends_the_block_after_the_first_unsure_token(draft, drafter_class):
    base = reference_greedy(draft, [4, 8, 15], 20)
    context = [4, 8, 15] + base + [4, 8, 15] + base[:5]  # repeats: MLA has proposals
    plain = ModelDrafter(CachedLM(draft)).propose(context, 15).tokens.tolist()
    probability = draft_probabilities(draft, context, plain)
    least_sure = int(probability.argmin())
    assert least_sure < 14  # the cut is visible
    # Just above the lowest probability: that token is the first below the threshold.
    threshold = float(probability.min()) * (1 + 1e-6)
    assert (probability[:least_sure] >= threshold).all()
    block = drafter_class(CachedLM(draft), min_confidence=threshold).propose(context, 15)
    assert block.tokens.tolist() == plain[: least_sure + 1]


def test_blocks_carry_the_draft_models_confidence(draft):
    base = reference_greedy(draft, [4, 8, 15], 20)
    context = [4, 8, 15] + base + [4, 8, 15] + base[:5]  # repeats: MLA has proposals
    plain = ModelDrafter(CachedLM(draft)).propose(context, 15)
    expected = draft_probabilities(draft, context, plain.tokens.tolist())
    expected = expected.float()
    assert torch.allclose(plain.confidence, expected, atol=1e-5)
    mla = MlaDrafter(CachedLM(draft), proposals=6).propose(context, 15)
    assert torch.allclose(mla.confidence, expected, atol=1e-5)
    assert NgramDrafter().propose(context, 5).confidence is None


def test_spd_with_draft_confidence_is_still_the_targets_greedy_output(target, draft):
    decoder = SpeculativeDecoder(target, draft)
    for drafter in ("model", "mla"):
        config = DecodeConfig(
            mode="spd", drafter=drafter, k=6, max_new_tokens=30, draft_confidence=0.02
        )
        stats = RequestStats()
        for prompt in PROMPTS:
            assert run(decoder, prompt, config, stats) == target_greedy(target, prompt, 30)
        assert min(r.drafted for r in stats.rounds) < 6  # some blocks did end early


def teacher_forced_argmax(model, prompt, tokens):
    """The target's greedy token before each of ``tokens`` given everything before it."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


def check_loosened_output(target, prompt, tokens, stats, window):
    """What any FLy output must satisfy: every token is the target's own greedy token except
    the recorded loose ones, and the ``window`` tokens after a loose one are the target's."""
    greedy = teacher_forced_argmax(target, prompt, tokens)
    mismatches = [i for i, (t, g) in enumerate(zip(tokens, greedy, strict=True)) if t != g]
    records = stats.loose_tokens
    assert mismatches == [r.output_index for r in records]
    for record in records:
        assert tokens[record.output_index] == record.draft_token
        assert greedy[record.output_index] == record.target_token
        assert record.rank >= 2 and 0 < record.ratio <= 1
        following = range(record.output_index + 1, record.output_index + 1 + window)
        assert all(tokens[i] == greedy[i] for i in following if i < len(tokens))
        assert record.output_index + window < len(tokens) or stats.finish_reason == "stop"


@pytest.mark.parametrize("k, window", [(4, 3), (6, 2), (5, 5)])
def test_deferral_across_blocks_keeps_the_rule(target, close_draft, k, window):
    decoder = SpeculativeDecoder(target, close_draft)
    prompt_stats = []
    for prompt in PROMPTS:
        stats = RequestStats()
        config = DecodeConfig(
            mode="fly", k=k, fly=FlyConfig(window=window, theta=0.0, defer=True), max_new_tokens=40
        )
        tokens = run(decoder, prompt, config, stats)
        assert len(tokens) == stats.emitted == 40
        assert stats.accepted + stats.loosely_accepted + stats.rejected == stats.drafted
        check_loosened_output(target, prompt, tokens, stats, window)
        prompt_stats.append(stats)
    confirmed = sum(s.deferrals("confirmed") for s in prompt_stats)
    rolled_back = sum(s.deferrals("rolled_back") for s in prompt_stats)
    assert confirmed > 0 and rolled_back > 0
    # A round that rolls a deferral back keeps nothing of its own block.
    rolling_back = [
        r for s in prompt_stats for r in s.rounds if r.decided and not r.decided.confirmed
    ]
    assert len(rolling_back) == rolled_back
    assert all(r.kept == 0 and r.emitted <= 1 for r in rolling_back)
    assert any(r.deferred for s in prompt_stats for r in s.loose_tokens)
    assert sum(len(s.loose_tokens) for s in prompt_stats) == sum(
        s.loosely_accepted for s in prompt_stats
    )


def test_the_plausibility_floor_keeps_only_plausible_tokens(target, close_draft):
    decoder = SpeculativeDecoder(target, close_draft)
    floor = FlyConfig(window=1, theta=0.0, min_ratio=0.5, max_rank=2)
    stats = RequestStats()
    tokens = run(decoder, PROMPTS[0], DecodeConfig(mode="fly", k=8, fly=floor), stats)
    check_loosened_output(target, PROMPTS[0], tokens, stats, 1)
    assert all(r.ratio >= 0.5 and r.rank <= 2 for r in stats.loose_tokens)
    unfloored = RequestStats()
    paper = FlyConfig(window=1, theta=0.0)
    run(decoder, PROMPTS[0], DecodeConfig(mode="fly", k=8, fly=paper), unfloored)
    assert any(r.ratio < 0.5 or r.rank > 2 for r in unfloored.loose_tokens)


def test_the_draft_doubt_loosens_only_tokens_the_draft_was_unsure_of(target, close_draft):
    decoder = SpeculativeDecoder(target, close_draft)
    paper = RequestStats()
    config = DecodeConfig(mode="fly", k=8, fly=FlyConfig(window=1, theta=0.0))
    run(decoder, PROMPTS[0], config, paper)
    confidences = sorted(r.draft_confidence for r in paper.loose_tokens)
    assert len(confidences) >= 2 and all(0 < c <= 1 for c in confidences)
    cap = (confidences[0] + confidences[-1]) / 2  # refuses some of what the paper's rule kept
    doubt = RequestStats()
    capped = config.with_updates(fly=FlyConfig(window=1, theta=0.0, max_draft_confidence=cap))
    tokens = run(decoder, PROMPTS[0], capped, doubt)
    check_loosened_output(target, PROMPTS[0], tokens, doubt, 1)
    assert all(r.draft_confidence <= cap for r in doubt.loose_tokens)
    ngram = RequestStats()
    run(decoder, PROMPTS[0], capped.with_updates(drafter="ngram"), ngram)
    assert ngram.loose_tokens == []  # prompt lookup gives no confidence: it counts as sure


@pytest.mark.parametrize("max_new_tokens", [1, 3, 9, 17])
def test_deferral_never_emits_past_max_new_tokens(target, close_draft, max_new_tokens):
    decoder = SpeculativeDecoder(target, close_draft)
    stats = RequestStats()
    config = DecodeConfig(
        mode="fly",
        k=4,
        fly=FlyConfig(window=3, theta=0.0, defer=True),
        max_new_tokens=max_new_tokens,
    )
    tokens = run(decoder, PROMPTS[2], config, stats)
    assert len(tokens) == max_new_tokens == stats.emitted


def test_deferral_with_infinite_theta_is_lossless(target, draft):
    decoder = SpeculativeDecoder(target, draft)
    config = DecodeConfig(
        mode="fly", k=4, fly=FlyConfig(theta=math.inf, defer=True, min_ratio=0.5), max_new_tokens=30
    )
    assert run(decoder, PROMPTS[1], config) == target_greedy(target, PROMPTS[1], 30)


def test_stopping_inside_held_tokens_counts_only_delivered_ones(target, close_draft):
    decoder = SpeculativeDecoder(target, close_draft)
    config = DecodeConfig(
        mode="fly", k=4, fly=FlyConfig(window=3, theta=0.0, defer=True), max_new_tokens=40
    )
    full = RequestStats()
    run(decoder, PROMPTS[0], config, full)
    for stop_after in range(1, 12):
        stats = RequestStats()
        events = decoder.stream(PROMPTS[0], config, stats=stats)
        received = [next(events) for _ in range(stop_after)]
        events.close()
        assert stats.emitted == len(received) == stop_after
        assert stats.finish_reason == "cancelled"


SEED_REJECTING_THE_DRAFT = 0
"""A seed whose first uniform draw (0.50) rejects the mismatching draft token by sampling."""


class FixedDrafter(Drafter):
    """Proposes the same block every round."""

    def __init__(self, block: list[int]) -> None:
        self.block = torch.tensor(block, dtype=torch.long)

    def reset(self) -> None:
        pass

    def propose(self, context, k):
        return Draft(tokens=self.block[:k])

    def observe(self, num_drafted: int, num_kept: int) -> None:
        pass


@pytest.mark.parametrize("temperature, expected_origin", [(4.0, "loose"), (1.0, "correction")])
def test_the_gate_reads_the_distribution_the_target_samples_from(
    target, temperature, expected_origin
):
    """At T > 0 FLy's entropy gate reads the logits after temperature (as vLLM's own FLy and
    its plugin do): a mismatch the raw logits call certain (top-3 entropy 0.003 nats) is
    uncertain at T = 4 (0.37 nats) and is loosened there."""
    block = [5, 6, 7]
    raw = torch.full((len(block) + 1, 64), -30.0)
    raw[0, 4], raw[0, 5] = 0.0, -8.0  # the target prefers 4 to the drafted 5
    raw[1, 6] = raw[2, 7] = raw[3, 8] = 30.0  # the rest of the block matches, then a bonus
    decoder = SpeculativeDecoder(target)
    raw = raw[:, : decoder.vocab_size]
    decoder.target.logits_with_block = lambda context, block, ids=None: raw[: len(block) + 1]
    config = DecodeConfig(
        mode="fly",
        k=len(block),
        max_new_tokens=len(block) + 1,
        fly=FlyConfig(window=2, theta=0.3),
        sampling=SamplingConfig(temperature=temperature, seed=SEED_REJECTING_THE_DRAFT),
    )
    events = list(decoder.stream([1, 2], config, drafter=FixedDrafter(block)))
    assert events[0].origin == expected_origin
    if expected_origin == "loose":
        assert [event.token for event in events] == [5, 6, 7, 8]


def test_a_decoder_that_reuses_its_prefix_reads_only_the_new_part_of_a_prompt(target, draft):
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=12)
    first, second = PROMPTS[2], PROMPTS[2] + [7, 7]  # the second prompt extends the first
    reusing = SpeculativeDecoder(target, draft, reuse_prefix=True)
    fed: list[int] = []  # new positions of each target forward
    forward = reusing.target.runner.forward

    def counted(input_ids, num_logits):
        fed.append(input_ids.shape[1])
        return forward(input_ids, num_logits)

    reusing.target.runner.forward = counted
    run(reusing, first, config)
    held = common_prefix_length(reusing.target.cached_tokens, second[:-1])
    assert held >= len(first)
    fed.clear()
    tokens = run(reusing, second, config)
    # The prefill reads only the positions the first request did not hold; where it held
    # them all, the first forward is the first round's: the last token and a block of K.
    assert fed[0] == (len(second) - 1 - held or config.k + 1)
    assert tokens == run(SpeculativeDecoder(target, draft), second, config)
    fresh = SpeculativeDecoder(target, draft)
    fresh.target.runner.forward = counted
    fed.clear()
    run(fresh, second, config)
    assert fed[0] == len(second) - 1  # without reuse: the whole prompt but its last token


@pytest.mark.parametrize("forward_path", ["lean", "compiled"])
@pytest.mark.parametrize("mode", ["target", "spd", "fly"])
def test_a_request_allocates_each_cache_once_however_long_it_runs(
    target, draft, forward_path, mode
):
    # 300 prompt tokens and 200 new ones: past the first capacity (256) and its doubling.
    prompt = [(7 * i + 3) % VOCAB for i in range(300)]
    config = DecodeConfig(mode=mode, k=6, max_new_tokens=200)
    decoder = SpeculativeDecoder(target, draft, forward_path=forward_path)
    tokens = run(decoder, prompt, config)
    assert decoder.target.runner.allocations == 1
    if mode != "target":
        assert decoder.draft.runner.allocations == 1
    if mode != "fly":
        assert tokens == target_greedy(target, prompt, 200)


def test_the_target_alone_runs_ahead_and_stops_where_the_rounds_did(target):
    """Greedy, the target alone launches each forward from the device's token before the
    host reads it: the tokens of plain greedy decoding, ended by the budget or an end token
    at the same place, and one read of the device a token."""
    prompt = PROMPTS[0]
    reference = reference_greedy(target, prompt, 20)
    config = DecodeConfig(mode="target", max_new_tokens=20)
    stats = RequestStats()
    with HostReads() as reads:
        assert run(SpeculativeDecoder(target), prompt, config, stats) == reference
    assert reads.count == len(reference) == stats.num_rounds
    assert reads.from_host == 1  # the prompt, copied to the device once; no token after it
    assert stats.finish_reason == "length"
    end = reference[5]  # an end token there: the request ends before it, one step late
    expected = reference[: reference.index(end)]
    decoder = SpeculativeDecoder(target, eos_token_ids={end})
    stats = RequestStats()
    assert run(decoder, prompt, config, stats) == expected
    assert stats.finish_reason == "stop" and stats.emitted == len(expected)
    # The next request of the decoder reads its own prompt: the step run ahead past the end
    # token is not left in what it continues.
    assert run(decoder, prompt, config) == expected


class Counting(Drafter):
    """Proposes a fixed block and counts what it is told (the hooks the protocol declares)."""

    def __init__(self) -> None:
        self.observed: list[tuple[int, int]] = []

    def reset(self) -> None:
        pass

    def propose(self, context, k):
        return Draft(tokens=torch.tensor([3] * k, dtype=torch.long))

    def observe(self, num_drafted: int, num_kept: int) -> None:
        self.observed.append((num_drafted, num_kept))


class ProposeOnly:
    """A drafter by shape alone that lacks the optional hooks and does not subclass."""

    def reset(self) -> None:
        pass

    def propose(self, context, k):
        return Draft(tokens=torch.tensor([3] * k, dtype=torch.long))


def test_a_drafter_is_told_each_verified_block_and_a_shapeless_one_is_refused(target):
    decoder = SpeculativeDecoder(target)
    counting = Counting()
    config = DecodeConfig(mode="spd", k=3, max_new_tokens=12)
    stats = RequestStats()
    events = list(decoder.stream([1, 2], config, drafter=counting, stats=stats))
    told = [(r.drafted, r.accepted) for r in stats.rounds if r.drafted]
    assert counting.observed == told and told[0][0] == 3
    assert sum(kept for _, kept in counting.observed) == sum(e.origin == "exact" for e in events)
    assert Counting().plan([1, 2]) is None  # the protocol's default: the settings' kind
    with pytest.raises(FlyspecError, match="ProposeOnly is not a drafter: subclass"):
        list(decoder.stream([1, 2], config, drafter=ProposeOnly()))


def test_the_loop_finds_no_drafter_method_by_name():
    """The drafter's optional hooks are the protocol's, called as methods: nothing in the
    decoding package looks a drafter's method up by name."""
    import flyspec.decoding

    package = Path(flyspec.decoding.__file__).parent
    for source in package.rglob("*.py"):
        for line in source.read_text().splitlines():
            assert not ("getattr(" in line and "drafter" in line), f"{source.name}: {line}"
