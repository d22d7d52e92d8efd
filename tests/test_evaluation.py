"""Tests of ``flyspec eval``: sandbox, answer extraction, statistics, cache, end to end on a
tiny random pair (fast; no dataset packages needed: problems are injected)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from flyspec.config import FlyConfig, SamplingConfig
from flyspec.evaluation.sandbox import run_sandboxed, sandbox_info
from flyspec.evaluation.tasks import (
    Gsm8kTask,
    HumanEvalTask,
    Outcome,
    extract_gsm8k_answer,
    extract_humaneval_code,
    normalize_number,
)
from flyspec.support.datasets import Gsm8kQuestion, HumanEvalProblem

# ---------------------------------------------------------------------------------- sandbox

FAST = {"timeout_s": 3.0, "memory_mb": 512}


def _confined() -> bool:
    """True when the sandbox runs programs as another, non-root user (the root backend)."""
    return sandbox_info().backend == "namespaces"


def test_sandbox_passes_a_correct_program():
    result = run_sandboxed("def f(x):\n    return x + 1\n\nassert f(1) == 2\n", **FAST)
    assert result.passed and result.status == "passed"


def test_sandbox_reports_an_assertion_failure():
    result = run_sandboxed("assert 1 + 1 == 3, 'arithmetic'\n", **FAST)
    assert not result.passed
    assert result.status == "failed"
    assert "AssertionError: arithmetic" in result.detail


def test_sandbox_reports_other_exceptions_and_syntax_errors_as_errors():
    assert run_sandboxed("raise KeyError('k')\n", **FAST).status == "error"
    syntax = run_sandboxed("def f(:\n", **FAST)
    assert syntax.status == "error" and "SyntaxError" in syntax.detail


def test_sandbox_kills_an_infinite_loop():
    started = time.monotonic()
    result = run_sandboxed("while True:\n    pass\n", timeout_s=1.0, memory_mb=512)
    assert not result.passed
    assert result.status == "timeout"
    assert time.monotonic() - started < 5


def test_sandbox_stops_a_fork_bomb():
    if not _confined() and os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not bind root; no non-root sandbox backend here")
    started = time.monotonic()
    result = run_sandboxed("import os\nwhile True:\n    os.fork()\n", timeout_s=3.0, memory_mb=512)
    assert not result.passed
    assert result.status in ("error", "timeout", "killed")
    assert time.monotonic() - started < 10


def test_sandbox_refuses_a_huge_allocation():
    result = run_sandboxed("block = bytearray(100 * 1024**3)\n", timeout_s=5.0, memory_mb=256)
    assert not result.passed
    assert result.status in ("error", "killed")


def test_sandbox_cannot_write_outside_its_folder(tmp_path):
    if not _confined():
        pytest.skip("the plain backend runs as the calling user and may write where it can")
    target = tmp_path / "escaped.txt"
    for path in (str(target), "../escaped.txt", "/tmp/flyspec-escaped.txt"):
        result = run_sandboxed(f"open({path!r}, 'w').write('x')\n", **FAST)
        assert not result.passed, path
    assert not target.exists()
    assert not os.path.exists("/tmp/flyspec-escaped.txt")
    # Its own working folder is writable.
    inside = run_sandboxed(
        "open('mine.txt', 'w').write('x')\nassert open('mine.txt').read()\n", **FAST
    )
    assert inside.passed


def test_sandbox_refuses_sockets_and_early_exit():
    assert not run_sandboxed("import socket\nsocket.socket()\n", **FAST).passed
    # Exiting with status 0 before the tests ran must not count as a pass.
    assert not run_sandboxed("import sys\nsys.exit(0)\nassert False\n", **FAST).passed
    assert not run_sandboxed("import os\nos._exit(0)\n", **FAST).passed


# -------------------------------------------------------------------------------- HumanEval

PROMPT = '''from typing import List


def below(numbers: List[int], limit: int) -> List[int]:
    """Keep the numbers below limit.
    >>> below([1, 5, 2], 3)
    [1, 2]
    """
'''
BODY = "    return [n for n in numbers if n < limit]\n"


def _run(code: str, entry_point: str = "below"):
    namespace: dict = {}
    exec(compile(code, "<test>", "exec"), namespace)  # trusted test code
    return namespace[entry_point]([1, 5, 2], 3)


@pytest.mark.parametrize(
    "completion",
    [
        BODY,  # bare body continuing the prompt
        "return [n for n in numbers if n < limit]\n",  # bare body without indentation
        # a full definition that repeats the signature (and omits the typing import)
        "def below(numbers: List[int], limit: int) -> List[int]:\n" + BODY,
        # a fenced block with prose around it, an example call and a main guard
        "Here is the solution:\n\n```python\ndef below(numbers, limit):\n"
        + BODY
        + "\n\nprint(below([1], 2))\nassert below([9], 1) == [9]\n\n"
        "if __name__ == '__main__':\n    print(input())\n```\nIt filters the list.",
        # a body followed by a closing fence and explanation
        BODY + "```\n\nThis keeps every number below the limit.",
        # a completion cut off by the token limit after a complete body
        BODY + "\n\ndef helper(x):\n    return (x +",
    ],
)
def test_humaneval_code_extraction(completion):
    code = extract_humaneval_code(PROMPT, "below", completion)
    assert _run(code) == [1, 2]
    assert "print(" not in code and "__main__" not in code


def test_humaneval_task_scores_in_the_sandbox():
    problem = HumanEvalProblem(
        task_id="Test/0",
        prompt=PROMPT,
        entry_point="below",
        test="def check(candidate):\n    assert candidate([1, 5, 2], 3) == [1, 2]\n",
        canonical_solution=BODY,
    )
    task = HumanEvalTask(timeout_s=5.0, memory_mb=512)
    assert task.score(problem, BODY, chat=True) == Outcome(True, "passed", "")
    wrong = task.score(problem, "    return numbers\n", chat=True)
    assert not wrong.correct and wrong.label == "failed"
    hang = HumanEvalTask(timeout_s=1.0, memory_mb=512).score(
        problem, "    while True:\n        pass\n", chat=True
    )
    assert not hang.correct and hang.label == "timeout"


# ------------------------------------------------------------------------------------ GSM8K


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $18 every day.\nThe answer is 18.", "18"),
        ("The answer is $1,234.", "1234"),
        ("So the total is 1,234,567 dollars.", "1234567"),
        ("The answer is 18 dollars.", "18"),
        ("It costs $18.", "18"),
        ("The temperature drops to -5 degrees.\nThe answer is -5.", "-5"),
        ("The answer is \u22123", "-3"),
        ("The answer is 3.50", "3.5"),
        ("#### 3.5", "3.5"),
        ("The answer is 7.0.", "7"),
        # several numbers: the final answer marker wins over later numbers ...
        ("The answer is 42. (Check: 40 + 2 = 42, and 6 * 7 = 43 - 1.)", "42"),
        # ... the last marker wins over an earlier one ...
        ("First I thought the answer is 10.\nRechecking: 5 + 7 = 12.\nThe answer is 12.", "12"),
        # ... without a marker, the last number; a subtraction is not a negative number
        ("16 - 3 - 4 = 9 eggs, and 9 * 2 = 18", "18"),
        ("10-4=6", "6"),
        ("Final answer: 25%", "25"),
        ("\\boxed{72}", "72"),
        ("Answer: 3, 4 and 5 are the sides", "3"),
        ("I cannot tell.", None),
    ],
)
def test_gsm8k_answer_extraction(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_gsm8k_number_normalisation_and_scoring():
    assert normalize_number("1,234.50") == "1234.5"
    assert normalize_number("$18") == "18"
    assert normalize_number("-0") == "0"
    assert normalize_number("abc") is None
    question = Gsm8kQuestion(index=3, question="?", solution="... #### 1,234", answer="1234")
    task = Gsm8kTask()
    assert task.score(question, "The answer is $1,234.00.", chat=True).correct
    assert not task.score(question, "The answer is 1,235.", chat=True).correct
    assert task.score(question, "no idea", chat=True).label == "no answer"
    assert task.is_complete("Step 1.\nThe answer is 18.\n")
    assert not task.is_complete("Step 1.\nThe answer is 18.")  # the line may continue
    assert not task.is_complete("To find the answer, add 3 and 4.\n")


# ------------------------------------------------------------------------------- statistics


def test_wilson_interval_on_hand_numbers():
    from flyspec.evaluation.report import wilson_interval

    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert low == pytest.approx(0.7225, abs=1e-4) and high == 1.0
    low, high = wilson_interval(33, 40)
    assert low == pytest.approx(0.6805, abs=1e-4) and high == pytest.approx(0.9125, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_bootstrap_recovery():
    from flyspec.evaluation.report import paired_bootstrap_recovery

    same = [True, False, True, True, False] * 4
    assert paired_bootstrap_recovery(same, same) == (100.0, 100.0)
    assert paired_bootstrap_recovery([False] * 5, [True] * 5) is None
    low, high = paired_bootstrap_recovery([True] * 20, [True] * 18 + [False] * 2)
    assert 70 <= low < 90 <= high <= 100


def _sample(problem_id, method, correct, tps, text="x", task="gsm8k"):
    from flyspec.evaluation.runner import Sample

    label = "correct (1)" if correct else "wrong (2)"
    stats = {"tokens_per_second": tps, "emitted": 10, "rounds": 10 if method == "target" else 4}
    return Sample(
        task, problem_id, method, text, stats, "stop", False, "k", Outcome(correct, label)
    )


def test_summary_reports_recovery_speedup_and_changed_outcomes(tmp_path):
    from flyspec.evaluation import report
    from flyspec.evaluation.runner import build_methods

    methods = build_methods(["target", "spd", "fly"], FlyConfig())
    samples = []
    for i, (target_ok, fly_ok) in enumerate(
        [(True, True), (True, False), (False, True), (True, True)]
    ):
        samples.append(_sample(f"p{i}", "target", target_ok, 2.0, text=f"t{i}"))
        samples.append(_sample(f"p{i}", "spd", target_ok, 2.0, text=f"t{i}"))
        samples.append(_sample(f"p{i}", "fly", fly_ok, 3.0, text=f"t{i}" if i == 0 else "y"))
    tasks = report.summarize(samples, methods, ["gsm8k"])
    fly = tasks["gsm8k"]["methods"]["fly"]
    assert fly["correct"] == 3 and fly["recovery_percent"] == pytest.approx(100.0)
    assert fly["speedup"] == pytest.approx(1.5) and fly["tau"] == pytest.approx(2.5)
    assert fly["time_speedup"] is None  # no timings in these samples
    assert fly["identical_to_target"] == 1
    assert [(c["id"], c["target"], c["method"]) for c in fly["changed"]] == [
        ("p1", "correct (1)", "wrong (2)"),
        ("p2", "wrong (2)", "correct (1)"),
    ]
    spd = tasks["gsm8k"]["methods"]["spd"]
    assert spd["changed"] == [] and spd["recovery_ci95"] == [100.0, 100.0]
    payload = {
        "created": "now",
        "models": {"target": {"path": "t"}, "draft": {"path": "d"}},
        "settings": {"decoding_summary": "greedy", "prompt_style": "chat template"},
        "sandbox": None,
        "cache": {"hits": 0, "misses": 12},
        "tasks": tasks,
    }
    assert report.plot_tradeoff(tmp_path / "plot.png", payload)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = report.render_markdown(payload)
    assert "| p1 | correct (1) | wrong (2) |" in markdown and "1.50x" in markdown


def test_methods_from_a_sweep():
    from flyspec.evaluation.runner import build_methods

    sweep = {"theta": [0.0, 0.3], "window": [0, 4, 6]}
    names = [m.name for m in build_methods(["target", "spd", "fly"], FlyConfig(), sweep)]
    assert names[:2] == ["target", "spd"] and len(names) == 8
    assert "fly-theta0-w4" in names and "fly-theta0.3-w6" in names
    assert [m.name for m in build_methods(["fly"], FlyConfig())] == ["fly"]
    rules = {
        "min_ratio": [0.0, 0.1],
        "max_rank": [0, 5],
        "max_draft_confidence": [1.0, 0.5],
        "defer": [False, True],
    }
    methods = build_methods(["fly"], FlyConfig(), rules)
    assert len(methods) == 16
    last = methods[-1]
    assert last.name == "fly-theta0.3-w6-ratio0.1-rank5-doubt0.5-defer"
    assert last.label == "FLy θ=0.3 W=6 ratio≥0.1 top-5 draft≤0.5 deferred"
    assert last.fly == FlyConfig(min_ratio=0.1, max_rank=5, max_draft_confidence=0.5, defer=True)
    assert last.as_dict()["max_draft_confidence"] == 0.5
    assert last.as_dict()["defer"] is True and methods[0].as_dict()["min_ratio"] == 0.0


# ---------------------------------------------------------------------- cache and end to end


def _problems():
    humaneval = [
        HumanEvalProblem(
            task_id=f"Tiny/{i}",
            prompt=f"def add{i}(a, b):\n    '''add two numbers'''\n",
            entry_point=f"add{i}",
            test="def check(candidate):\n    assert candidate(1, 2) == 3\n",
            canonical_solution="    return a + b\n",
        )
        for i in range(2)
    ]
    gsm8k = [
        Gsm8kQuestion(
            index=i, question=f"what is {i} plus 2?", solution=f"#### {i + 2}", answer=str(i + 2)
        )
        for i in range(2)
    ]
    return {"humaneval": humaneval, "gsm8k": gsm8k}


def _eval_args(tiny_pair, tmp_path, *extra):
    from flyspec.cli import build_parser

    draft, target = tiny_pair
    return build_parser().parse_args(
        [
            "eval",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--max-new-tokens",
            "8",
            "-k",
            "4",
            "--output",
            str(tmp_path / "out"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-progress",
            *extra,
        ]
    )


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, above all on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eval_end_to_end_on_tiny_models_with_cache(
    tiny_pair, tmp_path, monkeypatch, capsys, one_thread
):
    from flyspec.cli.evaluate import run_eval
    from flyspec.engine import Engine

    calls = {"n": 0}
    original = Engine.stream

    def counting_stream(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "stream", counting_stream)
    args = _eval_args(tiny_pair, tmp_path, "--theta", "0,0.3", "--window", "6")
    assert run_eval(args, problems=_problems()) == 0
    payload = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert set(payload["tasks"]) == {"humaneval", "gsm8k"}
    methods = payload["tasks"]["gsm8k"]["methods"]
    assert list(methods) == ["target", "spd", "fly-theta0-w6", "fly-theta0.3-w6"]
    assert all(m["n"] == 2 for m in methods.values())
    # lossless decoding reproduces the target's text exactly
    assert methods["spd"]["identical_to_target"] == 2
    assert len(payload["samples"]) == 16 and payload["cache"]["misses"] == 16
    assert "| target |" in (tmp_path / "out" / "eval.md").read_text()
    # eval.json and the console both name the sandbox backend that ran the HumanEval programs
    assert payload["sandbox"]["backend"] == sandbox_info().backend
    assert payload["sandbox"]["run_limits"] == sandbox_info().run_limits
    banner = f"sandbox for HumanEval programs: {sandbox_info().backend}, run-wide limits by"
    assert banner in capsys.readouterr().err
    generated = calls["n"]
    assert generated >= 16  # plus warm-ups

    # A rerun takes everything from the cache and never calls the engine.
    calls["n"] = 0
    assert run_eval(args, problems=_problems()) == 0
    assert calls["n"] == 0
    rerun = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert rerun["cache"]["hits"] == 16 and rerun["cache"]["misses"] == 0
    assert [s["text"] for s in rerun["samples"]] == [s["text"] for s in payload["samples"]]

    # A changed FLy setting misses for the fly methods only (target and spd are reused).
    changed = _eval_args(tiny_pair, tmp_path, "--theta", "0,0.3", "--window", "4")
    assert run_eval(changed, problems=_problems()) == 0
    third = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert third["cache"]["misses"] == 8 and third["cache"]["hits"] == 8
    assert all(s["cached"] == (s["method"] in ("target", "spd")) for s in third["samples"])


def test_cache_entries_are_atomic_json(tmp_path):
    from flyspec.config import DecodeConfig, FlyConfig
    from flyspec.decoding.loop import DECODER_REVISION
    from flyspec.evaluation.cache import GenerationCache, decoding_identity, generation_key

    common = {"task_version": "v", "prompt_ids": [1, 2], "target": {"p": 1}, "draft": {"p": 2}}
    common.update(dtype="float32", device="cpu")
    fly = generation_key(config=DecodeConfig(mode="fly"), **common)
    assert fly != generation_key(
        config=DecodeConfig(mode="fly", fly=FlyConfig(theta=0.0)), **common
    )
    assert fly != generation_key(config=DecodeConfig(mode="fly"), **{**common, "prompt_ids": [1]})
    # the target alone does not depend on drafting or FLy settings, nor on the draft model
    target = generation_key(config=DecodeConfig(mode="target"), **common)
    assert target == generation_key(
        config=DecodeConfig(mode="target", k=3, fly=FlyConfig(window=0)),
        **{**common, "draft": {"p": 3}},
    )
    # every setting that can change the text is in the key, with the decoder's revision
    assert fly != generation_key(config=DecodeConfig(mode="fly", draft_confidence=0.4), **common)
    assert target == generation_key(
        config=DecodeConfig(mode="target", draft_confidence=0.4), **common
    )
    assert decoding_identity(DecodeConfig(mode="fly"))["decoder_revision"] == DECODER_REVISION
    # kernels change rounding, so they are part of the key; the draft's only where it drafts
    kernels = {"forward": "lean", "draft_quant": "int8", "draft_forward": "lean"}
    fly_lean = generation_key(config=DecodeConfig(mode="fly"), kernels=kernels, **common)
    assert fly_lean != fly
    assert fly_lean != generation_key(
        config=DecodeConfig(mode="fly"), kernels={**kernels, "draft_quant": "none"}, **common
    )
    target_lean = generation_key(config=DecodeConfig(mode="target"), kernels=kernels, **common)
    assert target_lean == generation_key(
        config=DecodeConfig(mode="target"), kernels={**kernels, "draft_quant": "none"}, **common
    )
    assert target_lean != generation_key(
        config=DecodeConfig(mode="target"), kernels={**kernels, "forward": "x"}, **common
    )
    cache = GenerationCache(tmp_path)
    assert cache.get(fly) is None
    cache.put(fly, {"text": "hi"})
    assert cache.get(fly)["text"] == "hi"
    assert [p.suffix for p in (tmp_path / fly[:2]).iterdir()] == [".json"]
    (tmp_path / fly[:2] / f"{fly}.json").write_text("{truncated")
    assert cache.get(fly) is None  # a damaged entry is a miss


def test_eval_rejects_bad_options(tiny_pair, tmp_path):
    from flyspec.cli.evaluate import run_eval
    from flyspec.errors import FlyspecError

    for extra in (
        ["--task", "mmlu"],
        ["--modes", "fast"],
        ["--theta", "x"],
        ["--window", "-1"],
        ["--min-ratio", "2"],
        ["--max-rank", "-1"],
        ["--defer", "maybe"],
        ["--exec-timeout", "0"],
        ["--exec-memory-mb", "-5"],
    ):
        with pytest.raises(FlyspecError):
            run_eval(_eval_args(tiny_pair, tmp_path, *extra), problems=_problems())


def test_cached_generation_reuse_across_token_budgets():
    from flyspec.config import DecodeConfig
    from flyspec.evaluation.cache import reusable

    def entry(emitted, budget, finish="stop"):
        return {"token_ids": [0] * emitted, "max_new_tokens": budget, "finish_reason": finish}

    target = DecodeConfig(mode="target", max_new_tokens=384)
    fly = DecodeConfig(mode="fly", k=15, max_new_tokens=384)
    assert reusable(entry(300, 384, "length"), target)  # same budget: always
    assert reusable(entry(250, 320), target)  # ended before both budgets
    assert not reusable(entry(320, 320, "length"), target)  # hit its budget
    assert not reusable(entry(250, 240 + 15), DecodeConfig(mode="target", max_new_tokens=250))
    assert reusable(entry(250, 320), fly)  # 250 + 16 < 320
    assert not reusable(entry(310, 320), fly)  # the last blocks were shortened
    deferring = DecodeConfig(mode="fly", k=15, max_new_tokens=384, fly=FlyConfig(defer=True))
    assert reusable(entry(250, 320), deferring)  # 250 + 32 < 320
    assert not reusable(entry(290, 320), deferring)  # held tokens and the next block
    assert reusable(entry(310, 320), DecodeConfig(mode="spd", max_new_tokens=384))
    sampled = DecodeConfig(mode="fly", max_new_tokens=384, sampling=SamplingConfig(temperature=1))
    assert not reusable(entry(10, 320), sampled)


def test_limit_option_per_task():
    from flyspec.cli.evaluate import _limits
    from flyspec.errors import FlyspecError

    assert _limits(None) == {}
    assert _limits("5") == {"*": (0, 5)}
    assert _limits("humaneval=40,gsm8k=50") == {"humaneval": (0, 40), "gsm8k": (0, 50)}
    assert _limits("humaneval=40:100") == {"humaneval": (40, 100)}
    for bad in ("mmlu=3", "humaneval=x", "0", "humaneval=100:40", "humaneval=a:b", "-3:4"):
        with pytest.raises(FlyspecError):
            _limits(bad)


def test_tradeoff_labels_of_coinciding_points_are_merged():
    from flyspec.evaluation.report import _label_groups

    def point(label, mode, speedup, recovery):
        return {"label": label, "mode": mode, "speedup": speedup, "recovery_percent": recovery}

    groups = _label_groups(
        [
            point("target", "target", 1.0, 100.0),
            point("FLy θ=1 W=4", "fly", 1.61, 100.0),
            point("FLy θ=1 W=6", "fly", 1.60, 100.0),
            point("FLy θ=1 W=0", "fly", 1.61, 97.1),
            point("FLy θ=0 W=0", "fly", None, None),
        ]
    )
    assert groups == [
        ((1.0, 100.0, "target"), ["target"]),
        ((1.61, 100.0, "fly"), ["θ=1 W=4", "θ=1 W=6"]),
        ((1.61, 97.1, "fly"), ["θ=1 W=0"]),
    ]


def _loose(ratio, rank, entropy=0.7, position=3, draft_confidence=None):
    return {
        "output_index": 5,
        "position": position,
        "block_size": 15,
        "deferred": False,
        "draft_token": 1,
        "target_token": 0,
        "entropy": entropy,
        "draft_prob": ratio / 2,
        "top_prob": 0.5,
        "ratio": ratio,
        "rank": rank,
        "draft_confidence": draft_confidence,
    }


def test_loosening_analysis_joins_loose_tokens_with_outcomes(tmp_path):
    import dataclasses

    from flyspec.evaluation import loosening, report
    from flyspec.evaluation.runner import build_methods

    methods = build_methods(["target", "fly"], FlyConfig())
    samples = []
    # p0 lost with two implausible loose tokens, p1 unchanged with a plausible one, p2 gained.
    sure, unsure = {"draft_confidence": 0.95}, {"draft_confidence": 0.2}
    lost = [_loose(0.01, 9, **sure), _loose(0.04, 4, **sure)]
    cases = [(True, False, lost), (True, True, [_loose(0.8, 2, **unsure)])]
    cases.append((False, True, [_loose(0.3, 2, position=9, **unsure)]))
    for i, (target_ok, fly_ok, tokens) in enumerate(cases):
        samples.append(_sample(f"p{i}", "target", target_ok, 2.0))
        fly = _sample(f"p{i}", "fly", fly_ok, 3.0)
        samples.append(dataclasses.replace(fly, loose_tokens=tokens))
    analysis = loosening.analyse(samples, methods, ["gsm8k"])
    fly = analysis["gsm8k"]["fly"]
    assert [r["outcome"] for r in fly["tokens"]] == ["lost", "lost", "unchanged", "gained"]
    assert fly["features"]["lost"]["tokens"] == 2 and fly["features"]["lost"]["problems"] == 1
    assert fly["features"]["lost"]["rank"] == [5.25, 6.5, 7.75]  # inclusive quartiles
    assert fly["features"]["gained"]["position"] == [9.0, 9.0, 9.0]
    floors = {row["floor"]: row for row in fly["floors"]}
    assert floors["ratio >= 0.05"]["refused_lost"] == 1.0
    assert floors["ratio >= 0.05"]["refused_unchanged"] == 0.0
    assert floors["ratio >= 0.05"]["lost_problems_fully_refused"] == 1
    assert floors["rank <= 5"]["refused_lost"] == 0.5
    assert floors["rank <= 5"]["lost_problems_fully_refused"] == 0
    assert floors["draft confidence <= 0.5"]["refused_lost"] == 1.0
    assert floors["draft confidence <= 0.5"]["refused_unchanged"] == 0.0
    assert fly["features"]["unchanged"]["draft_confidence"] == [0.2, 0.2, 0.2]
    # Records made before the draft's confidence was recorded: its caps are left out.
    old = [dataclasses.replace(s, loose_tokens=[_loose(0.3, 2)]) for s in samples]
    old_floors = loosening.analyse(old, methods, ["gsm8k"])["gsm8k"]["fly"]["floors"]
    assert not any(row["floor"].startswith("draft") for row in old_floors)
    payload = {
        "created": "now",
        "models": {"target": {"path": "t"}, "draft": {"path": "d"}},
        "settings": {"decoding_summary": "greedy", "prompt_style": "chat template"},
        "sandbox": None,
        "cache": {"hits": 0, "misses": 6},
        "tasks": report.summarize(samples, methods, ["gsm8k"]),
        "loosening": analysis,
    }
    markdown = report.render_markdown(payload)
    assert "## What loosening did" in markdown
    assert "| ratio >= 0.05 | 100% | 0% | 0% | 1/1 |" in markdown
    assert loosening.plot(tmp_path / "loose.png", analysis)
    assert loosening.analyse(samples[:1], methods, ["gsm8k"]) == {}


def test_cache_keys_name_every_setting_the_mode_reads():
    from flyspec.config import DecodeConfig
    from flyspec.evaluation.cache import decoding_identity

    fly = decoding_identity(DecodeConfig(mode="fly", fly=FlyConfig(min_ratio=0.1, defer=True)))
    assert fly["fly"] == dataclasses.asdict(FlyConfig(min_ratio=0.1, defer=True))
    assert {"drafter", "k", "draft_confidence", "max_ngram"} <= set(fly)
    assert "max_new_tokens" not in fly
    assert "fly" not in decoding_identity(DecodeConfig(mode="spd"))
    target = decoding_identity(DecodeConfig(mode="target"))
    assert not {"fly", "k", "drafter", "draft_confidence", "max_ngram"} & set(target)
    assert {"sampling", "stop", "mode", "decoder_revision"} <= set(target)
