"""benchmarks/rules_frontier.py: recovery against tau of both families of FLy settings."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "rules_frontier.py"
_SPEC = importlib.util.spec_from_file_location("rules_frontier", _PATH)
rules_frontier = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(rules_frontier)


def method(label, mode="fly", recovery=95.0, tau=9.0, **rules):
    return {"label": label, "mode": mode, "recovery_percent": recovery, "tau": tau, **rules}


def write_run(path: Path, methods: list[dict]) -> Path:
    payload = {"tasks": {"humaneval": {"methods": {m["label"]: m for m in methods}}}}
    path.write_text(json.dumps(payload))
    return path


def test_both_families_from_several_runs(tmp_path, capsys):
    first = write_run(
        tmp_path / "a.json",
        [method("target", mode="target", recovery=100, tau=1), method("FLy θ=0.3 W=6")],
    )
    second = write_run(
        tmp_path / "b.json",
        [method("FLy θ=0.3 W=6 deferred", recovery=97.0, tau=9.5, defer=True)],
    )
    output = tmp_path / "frontier.png"
    assert rules_frontier.main([str(first), str(second), "--output", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "FLy θ=0.3 W=6: recovery 95.0%, tau 9.00" in printed
    assert "FLy θ=0.3 W=6 deferred: recovery 97.0%, tau 9.50" in printed
    settings = rules_frontier.settings_of([first, second], "humaneval")
    assert list(settings) == ["FLy θ=0.3 W=6", "FLy θ=0.3 W=6 deferred"]
    assert [rules_frontier.beyond_paper(s) for s in settings.values()] == [False, True]


def test_runs_without_fly_settings_are_an_error(tmp_path):
    run = write_run(tmp_path / "a.json", [method("target", mode="target", recovery=100, tau=1)])
    assert rules_frontier.main([str(run), "--output", str(tmp_path / "x.png")]) == 1
    assert not (tmp_path / "x.png").exists()
