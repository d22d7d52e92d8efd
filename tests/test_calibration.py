"""Per-pair calibration: the choice among measured rules, the saved file, and the commands
that start from it."""

from __future__ import annotations

import json

import pytest

from flyspec.calibration import (
    Calibration,
    Candidate,
    calibration_path,
    choose,
    fly_settings,
    load_calibration,
    save_calibration,
)
from flyspec.config import FlyConfig
from flyspec.errors import FlyspecError
from flyspec.support.datasets import Gsm8kQuestion, HumanEvalProblem


def candidate(theta: float, tau: float | None, **recovery: float | None) -> Candidate:
    return Candidate(fly=FlyConfig(theta=theta), recovery=recovery, tau=tau)


class TestChoice:
    def test_the_fastest_rule_that_keeps_enough_on_every_task(self):
        rules = [
            candidate(0.3, 10.0, humaneval=91.0, gsm8k=110.0),  # loses HumanEval
            candidate(0.5, 9.0, humaneval=99.5, gsm8k=100.0),
            candidate(1.0, 8.0, humaneval=100.0, gsm8k=100.0),
        ]
        assert choose(rules, min_recovery=99.0) is rules[1]
        assert choose(rules, min_recovery=99.6) is rules[2]
        assert choose(rules, min_recovery=90.0) is rules[0]

    def test_an_unmeasured_recovery_or_tau_never_qualifies(self):
        rules = [
            candidate(0.3, 10.0, humaneval=None, gsm8k=100.0),  # the target scored nothing
            candidate(0.5, None, humaneval=100.0),
        ]
        assert choose(rules, min_recovery=99.0) is None
        assert choose([], min_recovery=99.0) is None

    def test_a_tie_goes_to_the_first(self):
        rules = [candidate(0.3, 9.0, humaneval=100.0), candidate(0.5, 9.0, humaneval=100.0)]
        assert choose(rules, min_recovery=99.0) is rules[0]

    def test_rules_read_as_options(self):
        assert fly_settings(FlyConfig()) == "--theta 0.3 --window 6"
        rule = FlyConfig(theta=1.0, window=4, min_ratio=0.1, max_rank=3, defer=True)
        assert fly_settings(rule) == "--theta 1 --window 4 --min-ratio 0.1 --max-rank 3 --defer"
        doubt = FlyConfig(max_draft_confidence=0.5)
        assert fly_settings(doubt) == "--theta 0.3 --window 6 --max-draft-confidence 0.5"


def calibration(**fly) -> Calibration:
    return Calibration(
        fly=FlyConfig(**fly),
        min_recovery=99.0,
        recovery={"humaneval": 100.0},
        tau=8.5,
        problems={"humaneval": [0, 40]},
        created="2026-12-02 12:00:00 +0000",
        command="flyspec calibrate",
    )


class TestFile:
    def test_saved_and_loaded_unchanged(self, tmp_path):
        path = tmp_path / "calibration" / "pair.json"
        saved = calibration(theta=1.0, window=4, min_ratio=0.1, defer=True)
        save_calibration(saved, path)
        assert load_calibration(path) == saved
        assert [p.name for p in path.parent.iterdir()] == ["pair.json"]  # no temporary left
        assert "humaneval 0-39 100.0%" in saved.describe()

    def test_a_missing_file_is_no_calibration_and_a_damaged_one_an_error(self, tmp_path):
        path = tmp_path / "pair.json"
        assert load_calibration(path) is None
        path.write_text("{not json")
        with pytest.raises(FlyspecError, match="damaged.*flyspec calibrate"):
            load_calibration(path)
        path.write_text(json.dumps({**calibration().as_dict(), "format": 99}))
        with pytest.raises(FlyspecError, match="damaged"):
            load_calibration(path)
        path.write_text(json.dumps({**calibration().as_dict(), "fly": {"theta": -1}}))
        with pytest.raises(FlyspecError, match="damaged"):
            load_calibration(path)

    def test_the_path_names_the_pair(self, tiny_pair, tmp_path):
        draft, target = tiny_pair
        path = calibration_path(str(target), str(draft), home=tmp_path)
        assert path.parent == tmp_path / "calibration"
        assert path == calibration_path(str(target), str(draft), home=tmp_path)
        assert path != calibration_path(str(target), str(target), home=tmp_path)
        assert path != calibration_path("org/other-model", str(draft), home=tmp_path)


# ------------------------------------------------------------------------------- commands


def problems(*, passing: bool) -> dict:
    """Two HumanEval problems whose tests any program passes (``passing``) or none does."""
    test = "def check(candidate):\n    pass\n" if passing else "def check(c):\n    assert 0\n"
    humaneval = [
        HumanEvalProblem(
            task_id=f"Tiny/{i}",
            prompt=f"def f{i}(a):\n    '''return a'''\n",
            entry_point=f"f{i}",
            test=test,
            canonical_solution="    return a\n",
        )
        for i in range(2)
    ]
    gsm8k = [Gsm8kQuestion(index=0, question="1 + 1?", solution="#### 2", answer="2")]
    return {"humaneval": humaneval, "gsm8k": gsm8k}


def parse(tiny_pair, *arguments: str):
    from flyspec.cli import build_parser

    draft, target = tiny_pair
    return build_parser().parse_args(
        [arguments[0], "--target", str(target), "--draft", str(draft), *arguments[1:]]
    )


def calibrate(tiny_pair, tmp_path, *extra: str, passing: bool = True) -> int:
    from flyspec.cli.calibrate import run_calibrate

    args = parse(
        tiny_pair,
        "calibrate",
        "--task",
        "humaneval",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "-k",
        "4",
        "--theta",
        "0,inf",
        "--window",
        "0",
        "--output",
        str(tmp_path / "out"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-progress",
        *extra,
    )
    return run_calibrate(args, problems=problems(passing=passing))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_calibrate_saves_the_loosest_rule_and_commands_start_from_it(
    tiny_pair, tmp_path, home, capsys
):
    from flyspec.cli.options import decode_config_from_args

    assert calibrate(tiny_pair, tmp_path) == 0
    draft, target = tiny_pair
    saved = load_calibration(calibration_path(str(target), str(draft)))
    # Every program passes, so both rules keep 100%: theta 0 with W=0 keeps every drafted
    # token (the most tokens per round), theta inf is exact.
    assert saved.fly == FlyConfig(theta=0.0, window=0)
    assert saved.recovery == {"humaneval": 100.0} and saved.problems == {"humaneval": [0, 2]}
    out = capsys.readouterr()
    assert "| `--theta 0 --window 0` | 100.0% |" in out.out and "**chosen**" in out.out
    assert "saved as this pair's FLy rule" in out.err
    assert (tmp_path / "out" / "calibration.md").exists()

    config = decode_config_from_args(parse(tiny_pair, "generate", "x"))
    assert config.fly == FlyConfig(theta=0.0, window=0)
    assert "FLy rule calibrated for this pair: --theta 0 --window 0" in capsys.readouterr().err
    config = decode_config_from_args(parse(tiny_pair, "generate", "--window", "3", "x"))
    assert config.fly == FlyConfig(theta=0.0, window=3)  # an option given wins
    config = decode_config_from_args(parse(tiny_pair, "generate", "--no-calibration", "x"))
    assert config.fly == FlyConfig()
    assert decode_config_from_args(parse(tiny_pair, "serve")).fly == saved.fly
    assert decode_config_from_args(parse(tiny_pair, "bench", "--no-calibration")).fly == FlyConfig()


def test_calibrate_saves_nothing_when_no_rule_keeps_enough(tiny_pair, tmp_path, home, capsys):
    assert calibrate(tiny_pair, tmp_path, passing=False) == 0  # the target scores nothing
    assert not (home / "calibration").exists()
    out = capsys.readouterr()
    assert "No rule kept 99%" in out.out and "nothing saved" in out.err
    assert calibrate(tiny_pair, tmp_path, "--no-save") == 0
    assert not (home / "calibration").exists()
    assert "not saved (--no-save)" in capsys.readouterr().err


def test_calibrate_refuses_a_bad_recovery(tiny_pair, tmp_path, home):
    with pytest.raises(FlyspecError, match="--min-recovery"):
        calibrate(tiny_pair, tmp_path, "--min-recovery", "120")


def test_eval_ignores_calibrations(tiny_pair, tmp_path, home):
    from flyspec.cli.options import decode_config_from_args

    draft, target = tiny_pair
    save_calibration(calibration(theta=1.0), calibration_path(str(target), str(draft)))
    args = parse(tiny_pair, "eval")
    assert not hasattr(args, "no_calibration")
    rule = dict(theta=0.3, window=6, min_ratio=0.0, max_rank=0, max_draft_confidence=1.0)
    rule.update(defer=False, max_new_tokens=8)
    assert decode_config_from_args(args, **rule).fly == FlyConfig()


def test_models_list_names_the_default_pairs_rule(tiny_pair, home, monkeypatch, capsys):
    import flyspec.models
    from flyspec.cli import main

    draft, target = tiny_pair
    monkeypatch.setattr(flyspec.models, "is_default_pair_installed", lambda: True)
    monkeypatch.setattr(flyspec.models, "resolve_pair", lambda t, d: (str(target), str(draft)))
    assert main(["models", "list"]) == 0
    assert "calibrated for this pair: none (the paper's rule)" in capsys.readouterr().out
    save_calibration(calibration(theta=1.0, window=4), calibration_path(str(target), str(draft)))
    assert main(["models", "list"]) == 0
    assert "calibrated for this pair: --theta 1 --window 4 (kept" in capsys.readouterr().out
