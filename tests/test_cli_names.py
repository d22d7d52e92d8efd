"""The commands' option names: the current names show in --help, the former ones are hidden
and still parse to the same values, and one name means one thing in every command."""

import re

import pytest

from flyspec.cli import build_parser

# (command with its positionals, [(current spelling, former spelling), ...])
RENAMED = {
    "generate": (
        ["generate", "x"],
        [
            (["--model", "t"], ["--target", "t"]),
            (["--draft-model", "d"], ["--draft", "d"]),
            (["--num-speculative-tokens", "7"], ["--k", "7"]),
            (["-k", "auto"], ["--k", "auto"]),
            (["--max-tokens", "9"], ["--max-new-tokens", "9"]),
            (["--threads", "3"], ["--llamacpp-threads", "3"]),
        ],
    ),
    "serve": (
        ["serve"],
        [
            (["--model", "t"], ["--target", "t"]),
            (["--draft-model", "d"], ["--draft", "d"]),
            (["--num-speculative-tokens", "7"], ["--k", "7"]),
            (["--max-tokens", "9"], ["--max-new-tokens", "9"]),
            (["--served-model-name", "m"], ["--model-name", "m"]),
            (["--threads", "3"], ["--llamacpp-threads", "3"]),
        ],
    ),
    "bench": (
        ["bench"],
        [
            (["--model", "t"], ["--target", "t"]),
            (["--draft-model", "d"], ["--draft", "d"]),
            (["--num-speculative-tokens", "7"], ["--k", "7"]),
            (["--max-tokens", "9"], ["--max-new-tokens", "9"]),
            (["--threads", "3"], ["--llamacpp-threads", "3"]),
        ],
    ),
    "eval": (
        ["eval"],
        [
            (["--model", "t"], ["--target", "t"]),
            (["--draft-model", "d"], ["--draft", "d"]),
            (["--num-speculative-tokens", "7"], ["--k", "7"]),
            (["--max-tokens", "9"], ["--max-new-tokens", "9"]),
            (["--threads", "3"], ["--llamacpp-threads", "3"]),
            (["--modes", "spd,fly"], ["--mode", "spd,fly"]),
            (["--thetas", "0.3,1"], ["--theta", "0.3,1"]),
            (["--windows", "4,6"], ["--window", "4,6"]),
            (["--min-ratios", "0,0.1"], ["--min-ratio", "0,0.1"]),
            (["--max-ranks", "0,5"], ["--max-rank", "0,5"]),
            (["--max-draft-confidences", "1,0.5"], ["--max-draft-confidence", "1,0.5"]),
            (["--defers", "off,on"], ["--defer", "off,on"]),
            (["--tasks", "gsm8k"], ["--task", "gsm8k"]),
            (["--chat"], ["--prompt-style", "chat"]),
            (["--no-chat"], ["--prompt-style", "raw"]),
            ([], ["--prompt-style", "auto"]),
        ],
    ),
    "calibrate": (
        ["calibrate"],
        [
            (["--model", "t"], ["--target", "t"]),
            (["--draft-model", "d"], ["--draft", "d"]),
            (["--max-tokens", "9"], ["--max-new-tokens", "9"]),
            (["--threads", "3"], ["--llamacpp-threads", "3"]),
            (["--thetas", "0.3,1"], ["--theta", "0.3,1"]),
            (["--defers", "off,on"], ["--defer", "off,on"]),
            (["--chat"], ["--prompt-style", "chat"]),
        ],
    ),
}

CASES = [
    pytest.param(base, new, old, id=f"{base[0]} {old[0]}")
    for base, pairs in RENAMED.values()
    for new, old in pairs
]


def parsed(argv: list[str]) -> dict:
    return vars(build_parser().parse_args(argv))


def help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


def mentions(text: str, flag: str) -> bool:
    """Whether ``flag`` occurs as a whole option name (not ``--target`` in ``--target-quant``)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


@pytest.mark.parametrize(("base", "new", "old"), CASES)
def test_a_former_name_parses_as_the_current_one(base, new, old):
    assert parsed([*base, *old]) == parsed([*base, *new])
    assert parsed([*base, *new]) != parsed(base) or new == []  # the option does something


@pytest.mark.parametrize("command", list(RENAMED))
def test_help_shows_the_current_names_only(command, capsys):
    text = help_text(command, capsys)
    _, pairs = RENAMED[command]
    for new, old in pairs:
        if new and new[0].startswith("--"):
            assert mentions(text, new[0]), new[0]
        assert not mentions(text, old[0]), old[0]


@pytest.mark.parametrize("command", list(RENAMED))
def test_help_is_grouped(command, capsys):
    text = help_text(command, capsys)
    options = text.split("\noptions:\n")[1].split("\n\n")[0]
    assert options.strip().startswith("-h, --help") and options.count("\n  -") == 0
    for title in ("model:", "backend (what runs the forwards):"):
        assert f"\n{title}\n" in text
    assert "\nFLy's rule beyond the paper" in text or command == "bench"


def test_bench_has_the_rules_beyond_the_paper_but_not_a_mode(capsys):
    text = help_text("bench", capsys)
    assert "\nFLy's rule beyond the paper" in text
    assert not mentions(text, "--mode")


@pytest.mark.parametrize("command", [["generate", "x"], ["bench"], ["eval"], ["calibrate"]])
def test_one_chat_option_with_one_default_in_every_command(command):
    """--chat means the same everywhere: by default, when the tokenizer has a template."""
    assert parsed(command)["chat"] is None
    assert parsed([*command, "--chat"])["chat"] is True
    assert parsed([*command, "--no-chat"])["chat"] is False


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench"]])
def test_defer_is_a_switch_outside_eval_and_calibrate(command):
    assert parsed([*command, "--defer"])["defer"] is True
    assert parsed([*command, "--no-defer"])["defer"] is False


def test_the_singular_in_eval_still_reads_one_value():
    assert parsed(["eval", "--defer", "on"])["defer"] == "on"
    assert parsed(["eval", "--theta", "0.5"])["theta"] == "0.5"


def test_a_bad_prompt_style_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["eval", "--prompt-style", "fancy"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "choose from auto, chat, raw, got 'fancy'" in err and "Traceback" not in err


def test_serve_keeps_the_prompt_cache_unless_told_not_to():
    assert parsed(["serve"])["cache_prompt"] is True
    assert parsed(["serve", "--no-cache-prompt"])["cache_prompt"] is False
