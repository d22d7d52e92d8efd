"""``flyspec eval --engine vllm`` without vLLM: the answer cut, the cache identity, the
refusals before anything loads, and calibrate's deployment lines (tests/vllm runs engines)."""

import sys

import pytest

from flyspec.cli import main
from flyspec.config import FlyConfig
from flyspec.evaluation.calibrate import candidates_from, deployment_lines
from flyspec.evaluation.on_vllm import (
    cut_at_stop,
    first_true,
    truncate_at_answer,
    vllm_identity,
)
from flyspec.evaluation.runner import EvalMethod
from flyspec.evaluation.tasks import make_task
from flyspec.integrations.vllm.launch import VllmEngineSpec


def test_a_generation_is_cut_where_the_task_calls_the_answer_complete():
    task = make_task("gsm8k", timeout_s=1, memory_mb=64)
    words = ["So ", "5 + 3 = 8.", " The answer is 8.", "\n", "Extra: 9."]
    tokens, answered = truncate_at_answer(
        list(range(len(words))), lambda ids: "".join(words[i] for i in ids), task.is_complete
    )
    assert answered and tokens == [0, 1, 2, 3]
    assert truncate_at_answer([0, 1], lambda ids: "x", task.is_complete) == ([0, 1], False)


def test_the_cut_is_the_shortest_complete_prefix_at_every_answer_position():
    task = make_task("gsm8k", timeout_s=1, memory_mb=64)
    for length in range(1, 40):
        for answer in range(length):
            words = ["so 4 + 4 = 8. "] * length
            words[answer] = "The answer is 8.\n"
            tokens, answered = truncate_at_answer(
                range(length),
                lambda ids, words=words: "".join(words[i] for i in ids),
                task.is_complete,
            )
            assert answered and tokens == list(range(answer + 1))
    assert truncate_at_answer([], lambda ids: "The answer is 8.\n", task.is_complete) == (
        [],
        False,
    )


def test_the_cut_decodes_a_few_prefixes_not_every_one():
    task = make_task("gsm8k", timeout_s=1, memory_mb=64)
    length = 2000
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join("The answer is 8.\n" if i == length - 3 else "x " for i in ids)

    tokens, answered = truncate_at_answer(range(length), decode, task.is_complete)
    assert answered and len(tokens) == length - 2
    assert len(decoded) <= 2 * length.bit_length() + 1
    assert sum(decoded) <= 2 * length * length.bit_length()  # every prefix: length**2 / 2


def test_first_true_finds_the_first_of_a_monotone_predicate():
    for n in range(1, 70):
        for first in range(1, n + 1):
            asked = []

            def holds(end, first=first, asked=asked):
                asked.append(end)
                return end >= first

            assert first_true(holds, n) == first
            assert max(asked, default=0) <= max(2 * first, 1) and len(asked) <= 2 * n.bit_length()


def test_the_text_ends_before_the_first_stop_string_as_in_flyspecs_engine():
    assert cut_at_stop("    return x\n```\nmore\n```", ("\n```",)) == "    return x"
    assert cut_at_stop("a\nQuestion: b\n\n\n", ("\n\n\n", "\nQuestion:")) == "a"
    assert cut_at_stop("no stop here", ("\n```",)) == "no stop here"


def test_vllm_generations_are_cached_apart_from_flyspecs_and_by_kind_of_fly():
    plugin = vllm_identity(VllmEngineSpec(target="t", draft="d"), "0.32.0")
    native = vllm_identity(VllmEngineSpec(target="t", draft="d", native_fly="0.34.0"), "0.34.0")
    assert plugin.device == "vllm" and plugin.kernels["fly"] == "flyspec plugin"
    assert native.kernels["fly"] == "built in" and native.kernels != plugin.kernels


def test_calibration_takes_tau_from_vllms_engines():
    fly = EvalMethod("fly", "fly", FlyConfig())
    tasks = {"humaneval": {"methods": {"fly": {"tau": None, "recovery_percent": 100.0}}}}
    (candidate,) = candidates_from(tasks, [fly], {"fly": {"tau": 9.5}})
    assert candidate.tau == 9.5


def test_calibrate_prints_how_to_deploy_the_rule_on_both_kinds_of_vllm():
    native, plugin = deployment_lines(FlyConfig(window=4, theta=1.0))
    assert '"rejection_sample_method": "fly", "fly_window_size": 4' in native
    assert '"flyspec": {"rejection_sample_method": "fly", "fly_window_size": 4' in plugin
    native, plugin = deployment_lines(FlyConfig(defer=True))
    assert "not available (--defer" in native and "not available (deferral" in plugin


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--min-ratio", "0,0.1"], "--min-ratio (the plausibility floor) has no equivalent"),
        (["--defer", "on"], "--defer (deferral across blocks) has no equivalent"),
    ],
)
def test_eval_on_vllms_own_fly_refuses_rules_it_cannot_run_before_loading(
    capsys, monkeypatch, arguments, fragment
):
    monkeypatch.setitem(sys.modules, "vllm", object())  # require_vllm passes
    monkeypatch.setattr("flyspec.integrations.vllm.launch.native_fly_version", lambda: "0.34.0")
    monkeypatch.setattr(
        "flyspec.evaluation.run.run_evaluation",
        lambda *args, **kwargs: pytest.fail("nothing may load before the rules are checked"),
    )
    code = main(["eval", "--engine", "vllm", "--target", "t", "--draft", "d", *arguments])
    err = capsys.readouterr().err
    assert code != 0 and fragment in err and "Traceback" not in err
