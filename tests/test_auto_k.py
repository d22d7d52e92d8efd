"""-k auto: the expected tokens of a block, the cost table, the choice it makes on machines
where drafting pays and where it does not, and the decoder running it (lossless in SPD)."""

from __future__ import annotations

import json

import pytest
import torch

from flyspec.config import LONG_BLOCK, DecodeConfig, FlyConfig
from flyspec.decoding.auto_k.measure import measure_costs
from flyspec.decoding.auto_k.policy import (
    PROBE_AFTER,
    AutoK,
    AutoKPolicies,
    ForwardCosts,
    RequestAutoK,
    expected_tokens,
    largest_block,
    probe_sizes,
)
from flyspec.decoding.auto_k.store import costs_store
from flyspec.decoding.drafters import Draft, Drafter
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.models.cache import CachedLM
from flyspec.models.lean import COMPILED_MAX_TOKENS
from tests.tiny import make_tiny_model


def observe(
    policy: AutoK,
    *,
    drafted: int,
    kept: int,
    loose_positions: tuple[int, ...] | list[int] = (),
    draft_seconds: float = 0.0,
    verify_seconds: float = 0.0,
) -> None:
    """Fold in one round whose verdict is final, as the decoder does: costs, then acceptance."""
    policy.observe_costs(
        drafted=drafted, draft_seconds=draft_seconds, verify_seconds=verify_seconds
    )
    policy.observe_acceptance(drafted=drafted, kept=kept, loose_positions=loose_positions)


def test_expected_tokens_of_a_block():
    assert expected_tokens([]) == 1
    assert expected_tokens([1.0, 1.0, 1.0]) == 4
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.0, 1.0]) == 1


def test_forward_costs_interpolate_between_and_beyond_the_measured_sizes():
    costs = ForwardCosts({1: 0.04, 4: 0.10, 16: 0.28})
    assert costs(1) == 0.04
    assert costs(2) == pytest.approx(0.06)
    assert costs(10) == pytest.approx(0.19)
    assert costs(20) == pytest.approx(0.34)  # along the last segment
    costs.observe(4, 0.20)  # twice the table: every size follows, their ratios stay
    assert costs.scale == pytest.approx(0.7 + 0.3 * 2)
    assert costs(4) == pytest.approx(0.10 * costs.scale)
    assert costs(16) / costs(1) == pytest.approx(0.28 / 0.04)
    with pytest.raises(ValueError):
        ForwardCosts({})


def test_probe_sizes():
    assert probe_sizes(16) == [1, 2, 4, 8, 16]
    assert probe_sizes(6) == [1, 2, 4, 6]
    assert probe_sizes(1) == [1]


def observe_rounds(policy: AutoK, *, k: int, kept: int, rounds: int = 30) -> None:
    """Rounds that cost what the policy expects, with ``kept`` of ``k`` tokens kept."""
    for _ in range(rounds):
        observe(
            policy,
            drafted=k,
            kept=kept,
            draft_seconds=k * policy.draft_seconds,
            verify_seconds=policy.costs(k + 1),
        )


def test_where_a_block_costs_one_token_the_whole_block_is_drafted():
    """A memory-bound forward (a GPU, a big model): checking 16 tokens costs one token's time."""
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.1, 16: 0.1}), draft_seconds=0.001)
    observe_rounds(policy, k=15, kept=15)
    assert policy.choose() == 15
    observe_rounds(policy, k=15, kept=12, rounds=100)  # the last three positions never kept
    assert policy.choose() == 12


def test_where_a_block_costs_as_much_as_its_tokens_the_target_decodes_alone():
    """A compute-bound forward: a forward over n tokens costs n tokens, and drafting is not
    free, so no block can pay."""
    costs = ForwardCosts({1: 0.04, 16: 0.64})
    policy = AutoK(max_k=15, costs=costs, draft_seconds=0.02)
    observe_rounds(policy, k=8, kept=6)
    assert policy.choose() == 0


def test_a_short_block_wins_where_acceptance_falls_off():
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.1, 16: 0.25}), draft_seconds=0.01)
    observe_rounds(policy, k=15, kept=2)  # the first two positions kept, the third never
    assert 1 <= policy.choose() <= 4


def test_the_budget_left_caps_the_block():
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.1, 16: 0.1}))
    observe_rounds(policy, k=15, kept=15)
    assert policy.choose(3) == 3
    assert policy.choose(0) == 0


def test_fly_counts_a_loose_token_only_where_its_window_fits():
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.1}), window=6)
    for _ in range(50):
        observe(policy, drafted=15, kept=15, loose_positions=[0])
    fits = policy.rates(15)[0]  # position 1: 1 + 6 <= 15
    does_not = policy.rates(6)[0]  # 1 + 6 > 6
    assert fits > 0.9 and does_not < 0.2
    deferring = AutoK(max_k=15, costs=ForwardCosts({1: 0.1}), window=6, defer=True)
    for _ in range(50):
        observe(deferring, drafted=15, kept=15, loose_positions=[0])
    assert deferring.rates(6)[0] > 0.9


def plain_rounds(policy: AutoK, count: int) -> None:
    for _ in range(count):
        assert policy.choose() == 0
        observe(policy, drafted=0, kept=0, verify_seconds=policy.costs(1))


def test_after_many_rounds_of_the_target_alone_one_round_drafts_again_less_and_less_often():
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.1, 16: 0.3}), draft_seconds=0.02)
    observe_rounds(policy, k=8, kept=0)
    plain_rounds(policy, PROBE_AFTER)
    probe = policy.choose()
    assert probe > 0
    observe(policy, drafted=probe, kept=0, draft_seconds=0.02 * probe, verify_seconds=0.2)
    plain_rounds(policy, 2 * PROBE_AFTER)  # the probe found nothing: twice the wait
    assert policy.choose() > 0


def test_where_no_acceptance_could_pay_the_target_alone_never_probes():
    """llama.cpp's 4-bit forward on 2 cores (measured: n=1 39 ms, n=4 101, n=8 233, n=16 265)
    with a draft half as slow as the target: even a draft kept at 95% loses."""
    costs = ForwardCosts({1: 0.039, 4: 0.101, 8: 0.233, 16: 0.265})
    policy = AutoK(max_k=15, costs=costs, draft_seconds=0.02)
    observe_rounds(policy, k=8, kept=2)
    assert not policy.could_pay(15)
    plain_rounds(policy, 4 * PROBE_AFTER)


def test_rounds_teach_the_drafting_cost():
    policy = AutoK(max_k=4, costs=ForwardCosts({1: 0.1}))
    observe(policy, drafted=4, kept=4, draft_seconds=0.4, verify_seconds=0.1)
    assert policy.draft_seconds == pytest.approx(0.1)
    observe(policy, drafted=4, kept=4, draft_seconds=0.8, verify_seconds=0.1)
    assert policy.draft_seconds == pytest.approx(0.7 * 0.1 + 0.3 * 0.2)


@pytest.fixture(scope="module")
def tiny_decoder():
    draft = make_tiny_model(vocab_size=96, seed=1, num_layers=1)
    target = make_tiny_model(vocab_size=96, seed=2, num_layers=2)
    return SpeculativeDecoder(target, draft)


def test_auto_spd_emits_the_targets_greedy_tokens(tiny_decoder):
    prompt = [5, 17, 33, 8, 60]
    target = [e.token for e in tiny_decoder.stream(prompt, DecodeConfig(mode="target"))]
    config = DecodeConfig(mode="spd", k=6, auto_k=True, max_new_tokens=128)
    stats_tokens = list(tiny_decoder.stream(prompt, config))
    assert [e.token for e in stats_tokens] == target
    assert tiny_decoder.auto_k.block_costs is not None
    assert set(probe_sizes(7)) <= set(tiny_decoder.auto_k.block_costs.seconds)


def test_auto_fly_stays_within_its_largest_block_and_budget(tiny_decoder):
    from flyspec.decoding.stats import RequestStats

    stats = RequestStats()
    config = DecodeConfig(mode="fly", k=5, auto_k=True, max_new_tokens=40, fly=FlyConfig())
    tokens = list(tiny_decoder.stream([5, 17, 33], config, stats=stats))
    assert len(tokens) == 40
    assert all(r.drafted <= 5 for r in stats.rounds)


def test_the_config_takes_auto_k_as_a_flag():
    from flyspec.errors import FlyspecError

    with pytest.raises(FlyspecError, match="auto_k"):
        DecodeConfig(auto_k="yes")


def test_a_loose_keep_is_counted_only_where_the_window_could_fit():
    """Rounds of K=4 (a window of 6 never fits) say nothing of loose keeps: the loose rate
    that rounds of K=15 measured only fades towards the prior (counted as misses, it would
    fall to about 0.3 here)."""
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.1}), window=6)
    for _ in range(20):
        observe(policy, drafted=15, kept=15, loose_positions=[0])
    assert policy.rates(15)[0] > 0.95
    for _ in range(20):
        observe(policy, drafted=4, kept=0)  # position 1 reached, missed, no window possible
    assert policy.rates(15)[0] > 0.75
    assert policy.rates(4)[0] < 0.2  # its exact rate did fall


def test_a_held_deferral_gets_the_draft_tokens_that_decide_it():
    """The target alone is the best round here, yet a block of ``need`` is drafted while a
    deferred window waits on it (a smaller one would always roll the deferral back)."""
    policy = AutoK(max_k=15, costs=ForwardCosts({1: 0.04, 16: 0.64}), draft_seconds=0.02)
    observe_rounds(policy, k=8, kept=6)
    assert policy.choose() == 0
    assert policy.choose(15, at_least=4) >= 4
    assert policy.choose(3, at_least=4) == 3  # the budget caps it first


def test_a_deferral_is_learnt_once_decided():
    """A deferring round teaches nothing until the next round decides it; rolled back, its
    deferred position counts as a miss (not a keep), and the block of the round that rolled
    it back (drafted after tokens taken back) teaches nothing; confirmed, the held tokens
    count as kept, the deferred one loosely."""
    from flyspec.decoding.stats import DeferralDecision, LooseToken, RoundStats

    config = DecodeConfig(mode="fly", k=8, fly=FlyConfig(window=6, defer=True))
    timing = {"draft_seconds": 0.0, "verify_seconds": 0.01}
    deferring = RoundStats(
        drafted=8, accepted=3, loosely_accepted=0, emitted=3, deferred=True, **timing
    )
    loose = LooseToken(
        output_index=3, position=3, block_size=8, deferred=True, draft_token=1,
        target_token=2, entropy=0.5, draft_prob=0.2, top_prob=0.4, ratio=0.5, rank=2,
    )  # fmt: skip
    decisions = {
        "rolled back": DeferralDecision(confirmed=False, exact=0, loose_tokens=(), emitted=1),
        "confirmed": DeferralDecision(confirmed=True, exact=4, loose_tokens=(loose,), emitted=6),
    }
    learnt = {}
    for name, decision in decisions.items():
        policies = AutoKPolicies(block_costs=ForwardCosts({1: 0.01, 16: 0.02}))
        controller = RequestAutoK(policies, config)
        policy = policies.policy(config, "model")
        controller.choose("model", 8)
        controller.learn([deferring], drafted=8, draft_seconds=0.0, verify_seconds=0.01)
        assert sum(policy.reached) == 0
        deciding = RoundStats(
            drafted=2, accepted=0, loosely_accepted=0, emitted=decision.emitted,
            decided=decision, **timing,
        )  # fmt: skip
        controller.choose("model", 8)
        controller.learn([deferring, deciding], drafted=2, draft_seconds=0.0, verify_seconds=0.01)
        learnt[name] = (policy.reached[:8], policy.exact[:8], policy.loose[:8])
    reached, exact, loose_kept = learnt["rolled back"]
    assert [round(x) for x in reached] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [round(x) for x in exact] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert sum(loose_kept) == 0
    reached, exact, loose_kept = learnt["confirmed"]
    # The confirming round's own block (2 drafted, none kept), then the deferring one's (all
    # 8 kept), learnt after it.
    assert [round(x) for x in reached] == [2, 1, 1, 1, 1, 1, 1, 1]
    assert [round(x) for x in exact] == [1, 1, 1, 0, 1, 1, 1, 1]
    assert [round(x) for x in loose_kept] == [0, 0, 0, 1, 0, 0, 0, 0]


def target_drafting_for_itself(decoder: SpeculativeDecoder, k: int) -> None:
    """Forward costs of a memory-bound machine with a nearly free draft: -k auto drafts."""
    decoder.auto_k.block_costs = ForwardCosts({n: 0.01 for n in probe_sizes(k + 1)})
    decoder.auto_k.draft_token_seconds = 1e-4


def test_a_draft_that_has_caught_up_is_not_fed_again():
    """Each drafted token costs the draft one forward, and the prompt one more before the
    first block: a draft whose cache already holds the context is not run over it again."""
    from flyspec.decoding.stats import RequestStats

    model = make_tiny_model(vocab_size=96, seed=2, num_layers=2)
    decoder = SpeculativeDecoder(model, model)
    target_drafting_for_itself(decoder, k=4)
    config = DecodeConfig(mode="spd", k=4, auto_k=True, max_new_tokens=41)
    # The largest block always: what the rounds measure of their costs cannot change it.
    key = (config.mode, config.drafter, config.k, None, "model")
    decoder.auto_k.policies[key] = PrefersLongest(max_k=4, costs=decoder.auto_k.block_costs)
    stats = RequestStats()
    assert len(list(decoder.stream([5, 17, 33, 8, 60], config, stats=stats))) == 41
    drafted = sum(r.drafted for r in stats.rounds)
    assert drafted == 32  # eight full blocks, all kept
    assert decoder.draft.forward_calls == drafted + 1


class PrefersLongest(AutoK):
    """Prefers the largest block allowed."""

    def tokens_per_second(self, k: int) -> float:
        return k


class ScriptedPreference(AutoK):
    """Prefers the largest block in the first round and the target alone after it."""

    rounds_seen = 0

    def choose(self, limit: int | None = None, **bounds) -> int:
        chosen = super().choose(limit, **bounds)
        self.rounds_seen += 1
        return chosen

    def tokens_per_second(self, k: int) -> float:
        return k if self.rounds_seen == 0 else -k


def test_under_auto_a_deferred_window_can_be_confirmed():
    """The target drafts for itself but for one token: where that token's window runs past
    the block, it is deferred, and the next block, though the policy prefers the target
    alone, drafts enough tokens to confirm it."""
    from flyspec.decoding.stats import RequestStats

    model = make_tiny_model(vocab_size=96, seed=2, num_layers=2)
    prompt = [5, 17, 33, 8, 60]
    greedy = [
        e.token
        for e in SpeculativeDecoder(model).stream(
            prompt, DecodeConfig(mode="target", max_new_tokens=4)
        )
    ]
    spoiled = (greedy[2] + 1) % 96
    fly = FlyConfig(window=3, theta=0.0, defer=True)
    config = DecodeConfig(mode="fly", k=4, auto_k=True, max_new_tokens=24, fly=fly)

    class SpoilThird(Drafter):
        """The target's greedy continuation, with its third token replaced."""

        def __init__(self) -> None:
            self.lm = CachedLM(model)

        def reset(self) -> None:
            self.lm.reset()

        def propose(self, context, k):
            tokens = []
            for _ in range(k):
                token = int(self.lm.logits(list(context) + tokens, 1)[0].argmax())
                if len(context) + len(tokens) == len(prompt) + 2:
                    token = spoiled
                tokens.append(token)
            return Draft(tokens=torch.tensor(tokens, dtype=torch.long))

    decoder = SpeculativeDecoder(model, model)
    target_drafting_for_itself(decoder, k=4)
    key = (config.mode, config.drafter, config.k, fly, "model")
    decoder.auto_k.policies[key] = ScriptedPreference(
        max_k=4, costs=decoder.auto_k.block_costs, window=3, defer=True
    )
    stats = RequestStats()
    tokens = [e.token for e in decoder.stream(prompt, config, stats=stats, drafter=SpoilThird())]
    assert stats.rounds[0].deferred and stats.rounds[1].decided.confirmed
    assert tokens[2] == spoiled
    assert stats.rounds[1].drafted >= 1


def test_the_decoder_reads_the_vocabulary_size_of_any_language_model():
    model = make_tiny_model(vocab_size=96, seed=2, num_layers=1)
    assert CachedLM(model).vocab_size == 96
    assert SpeculativeDecoder(model).vocab_size == 96


class BoundedLM(CachedLM):
    """A torch model whose cache holds at most ``context_length`` positions, as llama.cpp's."""

    def __init__(self, model, context_length: int) -> None:
        super().__init__(model)
        self.context_length = context_length

    def logits(self, tokens, num_logits=1):
        assert len(tokens) <= self.context_length, f"{len(tokens)} > {self.context_length}"
        return super().logits(tokens, num_logits)


def test_the_cost_probe_stays_within_the_context():
    """A prompt of 20 tokens and 12 new ones fill a context of 32: the probe of -k auto times
    no block that the request itself could not hold (K=15 would need 35 positions)."""
    model = make_tiny_model(vocab_size=96, seed=2, num_layers=1)
    decoder = SpeculativeDecoder(
        BoundedLM(model, 32), make_tiny_model(vocab_size=96, seed=1, num_layers=1)
    )
    config = DecodeConfig(mode="fly", k=15, auto_k=True, max_new_tokens=12, fly=FlyConfig())
    prompt = [(7 * i) % 90 + 4 for i in range(20)]
    assert len(list(decoder.stream(prompt, config))) == 12
    assert max(decoder.auto_k.block_costs.seconds) == 12


def test_on_a_gpu_the_cost_probe_times_finished_forwards(monkeypatch):
    """CUDA runs a forward asynchronously: the clock (flyspec's forward timer) waits for the
    device before and after each timed forward, so that the time is that forward's alone."""
    from flyspec.decoding.auto_k.measure import measure_block_costs

    calls = []

    class QueuedLM:
        device = torch.device("cuda")

        def logits(self, tokens, num_logits=1):
            calls.append("forward")
            return torch.zeros(num_logits, 4)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("wait"))
    measure_block_costs(QueuedLM(), [1, 2, 3], [1, 2])
    assert calls == ["wait", "forward", "wait"] * 2


def test_the_controller_chooses_with_the_policy_of_the_kind_it_is_given():
    """The loop says what kind of block comes next; only a block of the draft model costs
    drafting time, so where drafting is dear the model's policy drafts nothing and a free
    kind drafts."""
    policies = AutoKPolicies(block_costs=ForwardCosts({1: 0.1, 16: 0.15}), draft_token_seconds=1.0)
    controller = RequestAutoK(policies, DecodeConfig(mode="spd", k=15, auto_k=True))
    assert controller.choose("model", 15) == 0
    assert controller.choose("prediction", 15) > 0
    assert {key[-1] for key in policies.policies} == {"model", "prediction"}


def test_a_predictions_run_may_go_past_k_where_long_blocks_cost_little():
    # Flat costs (a GPU): a prediction's run takes blocks up to LONG_BLOCK, the model's -k.
    policies = AutoKPolicies(block_costs=ForwardCosts({1: 0.1, 16: 0.101}), draft_token_seconds=0.0)
    config = DecodeConfig(mode="spd", k=15, auto_k=True)
    controller = RequestAutoK(policies, config)
    assert largest_block(config, "prediction") == LONG_BLOCK == 64
    assert COMPILED_MAX_TOKENS == LONG_BLOCK + 1  # the block and the token before it
    assert largest_block(config, "model") == largest_block(config, "prediction-found") == 15
    for _ in range(10):  # the prediction's blocks are kept whole
        observe(policies.policy(config, "prediction"), drafted=15, kept=15, verify_seconds=0.1)
    assert controller.choose("prediction", 100) == LONG_BLOCK
    assert controller.choose("prediction", 40) == 40  # the budget left caps it
    assert controller.choose("lookup", 100) <= 15


def test_a_decoder_under_auto_drafts_a_predictions_run_in_blocks_past_k(tiny_decoder):
    from flyspec.decoding.stats import RequestStats

    prompt = [5, 17, 33, 8, 60]
    alone = DecodeConfig(mode="target", max_new_tokens=150)
    answer = [e.token for e in tiny_decoder.stream(prompt, alone)]
    decoder = SpeculativeDecoder(tiny_decoder.target, tiny_decoder.draft)
    decoder.auto_k.block_costs = ForwardCosts({n: 0.01 for n in probe_sizes(9)})  # measured
    stats = RequestStats()
    config = DecodeConfig(mode="spd", drafter="ngram", k=8, auto_k=True, max_new_tokens=150)
    tokens = [e.token for e in decoder.stream(prompt, config, stats=stats, prediction=answer)]
    assert tokens == answer
    assert max(r.drafted for r in stats.rounds) > 8
    assert all(r.drafted <= LONG_BLOCK for r in stats.rounds)


def test_measured_costs_are_kept_for_the_next_process(tmp_path):
    target = CachedLM(make_tiny_model(vocab_size=96, seed=2, num_layers=1))
    context = [5, 17, 33, 8, 60]
    config = DecodeConfig(mode="spd", k=6, auto_k=True)
    store = costs_store({"target": "tiny"}, home=tmp_path)
    assert store.path.parent == tmp_path / "forward-costs"
    assert store != costs_store({"target": "other"}, home=tmp_path)
    first = AutoKPolicies()
    target.logits(context[:-1])
    measure_costs(first, target, context, config, store=store)
    assert store.path.is_file() and target.forward_calls > 1
    # Another process, the same machine and models: no forward to measure.
    second, calls = AutoKPolicies(), target.forward_calls
    measure_costs(second, target, context, config, store=store)
    assert target.forward_calls == calls
    assert second.block_costs.seconds == first.block_costs.seconds
    # A larger -k measures only the sizes not kept; a damaged file is measured anew.
    measure_costs(AutoKPolicies(), target, context, config.with_updates(k=12), store=store)
    kept = json.loads(store.path.read_text())["seconds"]
    assert set(probe_sizes(13)) <= {int(n) for n in kept}
    store.path.write_text("{not json")
    third = AutoKPolicies()
    measure_costs(third, target, context, config, store=store)
    assert target.forward_calls > calls and third.block_costs is not None


def test_an_engine_keeps_its_costs_under_flyspec_home(tiny_ggufs):
    from flyspec.config import LlamaCppConfig
    from flyspec.engine import Engine
    from flyspec.support.home import flyspec_home

    _, _, _, draft_path, target_path = tiny_ggufs
    settings = LlamaCppConfig(context=512, threads=1)
    load = dict(target=str(target_path), draft=str(draft_path), backend="llamacpp")
    engine = Engine.load(**load, llamacpp=settings)
    store = engine.decoder.auto_k_store
    assert store.path.parent == flyspec_home() / "forward-costs"
    # Other threads run other forwards: kept apart.
    other = Engine.load(**load, llamacpp=LlamaCppConfig(context=512, threads=2))
    assert other.decoder.auto_k_store != store
