"""The vLLM plugin's settings and engine mapping, without vLLM (tests/vllm has the rest)."""

import dataclasses
import math

import pytest

from flyspec.config import FlyConfig
from flyspec.errors import FlyspecError
from flyspec.integrations.vllm import VllmPluginError, additional_config, parse_settings
from flyspec.integrations.vllm.launch import NATIVE_FLY_FIELDS, VllmEngineSpec, config_fields
from flyspec.integrations.vllm.settings import section_from, section_refused_by_native_fly


def test_no_section_leaves_verification_exact():
    assert parse_settings(None) is None


def test_an_empty_section_switches_fly_on_with_flyspec_defaults():
    assert parse_settings({}) == FlyConfig()


def test_upstream_names_map_onto_the_rule():
    section = {
        "rejection_sample_method": "fly",
        "fly_window_size": 4,
        "fly_entropy_threshold": 0.5,
        "fly_entropy": "normalized",
    }
    assert parse_settings(section) == FlyConfig(window=4, theta=0.5, entropy="normalized")


def test_standard_method_and_infinite_theta_are_exact():
    assert parse_settings({"rejection_sample_method": "standard"}) is None
    assert parse_settings({"fly_entropy_threshold": math.inf}) is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"window": 3}, "unknown key(s) in additional_config['flyspec']: window"),
        ({"rejection_sample_method": "lossy"}, "rejection_sample_method must be one of"),
        ({"fly_window_size": -1}, "window must be an integer >= 0, got -1"),
        ({"fly_window_size": True}, "must be numbers"),
        ({"fly_entropy_threshold": "high"}, "theta must be a number"),
        ({"fly_entropy": "full"}, "entropy must be one of top3, normalized"),
        ([1, 2], "must be an object"),
    ],
)
def test_bad_settings_name_what_is_wrong(section, message):
    with pytest.raises(VllmPluginError) as raised:
        parse_settings(section)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_environment_is_a_fallback_only():
    environ = {"FLYSPEC_VLLM": '{"fly_window_size": 3}'}
    assert section_from({}, environ) == {"fly_window_size": 3}
    assert section_from({"flyspec": {"fly_window_size": 5}}, environ) == {"fly_window_size": 5}
    with pytest.raises(VllmPluginError, match="FLYSPEC_VLLM is not valid JSON"):
        section_from({}, {"FLYSPEC_VLLM": "{window: 3"})


def test_additional_config_round_trips():
    fly = FlyConfig(window=5, theta=0.2, entropy="normalized")
    assert parse_settings(additional_config(fly)["flyspec"]) == fly
    assert parse_settings(additional_config(None)["flyspec"]) is None


def test_engine_specs_map_modes_and_drafters():
    spec = VllmEngineSpec(target="t", draft="d", mode="fly", k=7, fly=FlyConfig(window=2))
    assert spec.speculative_config() == {
        "method": "draft_model",
        "model": "d",
        "num_speculative_tokens": 7,
    }
    assert parse_settings(spec.additional_config()["flyspec"]) == FlyConfig(window=2)
    exact = VllmEngineSpec(target="t", draft="d", mode="spd", k=7)
    assert exact.additional_config() == {}
    ngram = VllmEngineSpec(target="t", mode="spd", drafter="ngram", k=4)
    assert ngram.speculative_config()["method"] == "ngram"
    assert VllmEngineSpec(target="t", mode="target").speculative_config() is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"drafter": "mla"}, "runs in flyspec's own engine only"),
        ({"draft": None}, "needs a draft model"),
        ({"mode": "lossy"}, "mode must be one of"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be >= 1"),
    ],
)
def test_engine_specs_refuse_what_vllm_cannot_run(kwargs, message):
    with pytest.raises(FlyspecError) as raised:
        VllmEngineSpec(**{"target": "t", "draft": "d", **kwargs})
    assert message in str(raised.value)


def test_vllm_stats_are_per_request_differences_of_running_totals():
    from flyspec.integrations.vllm.engine import VllmStats

    before = VllmStats(rounds=3, drafted=45, accepted_with_loose=30, loosely_accepted=1)
    after = VllmStats(
        rounds=5,
        drafted=75,
        accepted_with_loose=52,
        loosely_accepted=2,
        accepted_per_position=(5, 4),
    )
    request = after - before
    assert request.as_dict() == {
        "rounds": 2,
        "drafted": 30,
        "accepted": 21,
        "loosely_accepted": 1,
        "tau": 12.0,
    }
    assert request.accepted_per_position == (5, 4)
    assert (request + before).accepted_with_loose == 52
    assert request.per_position_acceptance() == [2.5, 2.0]


def test_a_vllm_summary_pools_its_requests():
    from flyspec.bench.methods import SampleRun
    from flyspec.bench.vllm import VllmRuns, summarise_vllm_runs
    from flyspec.integrations.vllm.engine import VllmStats

    stats = VllmStats(rounds=2, drafted=30, accepted_with_loose=20, loosely_accepted=2)
    runs = VllmRuns(
        "vllm-fly", {"mode": "fly"}, 33.3, [SampleRun([1] * 22, 2.0, stats)] * 2, (88, 4.0)
    )
    records = [
        {
            "prompt_id": f"p{index}",
            "tokens_per_second": 11.0,
            "new_tokens": 22,
            "seconds": 2.0,
            "identical_to_target": False,
        }
        for index in range(2)
    ]
    summary = summarise_vllm_runs(runs, records, [5.5, 5.5], k=15)
    assert summary["speedup"] == 2.0
    assert summary["tau"] == 11.0
    assert summary["accepted"] == 36 and summary["loosely_accepted"] == 4
    assert summary["loose_acceptance_rate"] == round(4 / 60, 4)
    assert summary["concurrent_tokens_per_second"] == 22.0
    assert summary["kind"] == "vllm" and summary["engine_start_seconds"] == 33.3


def test_the_plausibility_floor_reaches_vllm_and_deferral_and_the_draft_doubt_are_refused():
    fly = FlyConfig(window=4, theta=0.3, min_ratio=0.2, max_rank=5)
    section = additional_config(fly)["flyspec"]
    assert section["fly_min_ratio"] == 0.2 and section["fly_max_rank"] == 5
    assert parse_settings(section) == fly
    assert "fly_min_ratio" not in additional_config(FlyConfig())["flyspec"]
    with pytest.raises(VllmPluginError, match="deferral"):
        additional_config(FlyConfig(defer=True))
    with pytest.raises(VllmPluginError, match="max-draft-confidence"):
        additional_config(FlyConfig(max_draft_confidence=0.5))
    with pytest.raises(VllmPluginError, match="unknown key"):
        parse_settings({"fly_max_draft_confidence": 0.5})
    with pytest.raises(VllmPluginError, match="min_ratio"):
        parse_settings({"fly_min_ratio": 3})


NATIVE = "0.34.0"


def test_a_vllm_with_fly_built_in_gets_speculative_config_keys():
    spec = VllmEngineSpec(
        target="t", draft="d", k=9, fly=FlyConfig(window=4, theta=0.5), native_fly=NATIVE
    )
    assert spec.speculative_config() == {
        "method": "draft_model",
        "model": "d",
        "num_speculative_tokens": 9,
        "rejection_sample_method": "fly",
        "fly_window_size": 4,
        "fly_entropy_threshold": 0.5,
        "fly_entropy_top_k": 3,
    }
    assert spec.additional_config() == {}


def test_exact_modes_on_a_vllm_with_fly_built_in_leave_its_verification_alone():
    exact = VllmEngineSpec(target="t", draft="d", mode="spd", k=5, native_fly=NATIVE)
    assert "rejection_sample_method" not in exact.speculative_config()
    never = VllmEngineSpec(
        target="t", draft="d", k=5, fly=FlyConfig(theta=math.inf), native_fly=NATIVE
    )
    assert never.speculative_config()["rejection_sample_method"] == "standard"
    assert VllmEngineSpec(target="t", mode="target", native_fly=NATIVE).speculative_config() is None


@pytest.mark.parametrize(
    ("fly", "option"),
    [
        (FlyConfig(entropy="normalized"), "--entropy normalized"),
        (FlyConfig(min_ratio=0.1), "--min-ratio"),
        (FlyConfig(max_rank=3), "--max-rank"),
        (FlyConfig(defer=True), "--defer"),
        (FlyConfig(max_draft_confidence=0.5), "--max-draft-confidence"),
        (FlyConfig(window=0), "--window 0"),
    ],
)
def test_rules_vllms_own_fly_has_no_equivalent_of_are_refused_in_one_line(fly, option):
    with pytest.raises(VllmPluginError) as raised:
        VllmEngineSpec(target="t", draft="d", fly=fly, native_fly=NATIVE)
    message = str(raised.value)
    assert message.startswith(option) and f"vLLM {NATIVE}" in message and "\n" not in message


def test_a_flyspec_section_on_a_vllm_with_fly_built_in_names_the_keys_to_use():
    error = section_refused_by_native_fly({"fly_window_size": 4}, vllm_version=NATIVE)
    message = str(error)
    assert "remove additional_config['flyspec']" in message and "\n" not in message
    assert (
        '{"rejection_sample_method": "fly", "fly_window_size": 4, "fly_entropy_threshold": 0.3, '
        '"fly_entropy_top_k": 3} to speculative_config' in message
    )
    refused = section_refused_by_native_fly({"fly_min_ratio": 0.2}, vllm_version=NATIVE)
    assert str(refused).startswith("--min-ratio")


def test_fly_built_in_is_read_from_the_config_fields():
    @dataclasses.dataclass
    class WithFly:
        num_speculative_tokens: int = 1
        rejection_sample_method: str = "standard"
        fly_window_size: int | None = None
        fly_entropy_threshold: float = 0.3
        fly_entropy_top_k: int = 3

    @dataclasses.dataclass
    class WithoutFly:
        num_speculative_tokens: int = 1
        rejection_sample_method: str = "standard"

    assert config_fields(WithFly) >= NATIVE_FLY_FIELDS
    assert not config_fields(WithoutFly) >= NATIVE_FLY_FIELDS


def test_a_window_that_does_not_fit_the_block_is_refused_by_vllms_own_fly():
    with pytest.raises(FlyspecError, match="--window 6 does not fit in the block of -k 6"):
        VllmEngineSpec(target="t", draft="d", k=6, native_fly=NATIVE)
    VllmEngineSpec(target="t", draft="d", k=7, native_fly=NATIVE)
    VllmEngineSpec(target="t", draft="d", k=6)  # the plugin: nothing is loosened, a warning
