"""End to end on the real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B), greedy.

About two to three minutes on 2 CPU cores: the target alone makes ~3 tokens/s.
"""

import gc

import pytest

from flyspec.config import DecodeConfig
from tests.conftest import load_default_engine

pytestmark = pytest.mark.e2e

# Two prompts on which FLy loosens tokens with the default kernels (int8 draft): one alone
# would leave the test to the rounding of one CPU's kernels.
PROMPTS = (
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def results():
    """Each prompt's generation in each mode; the pair is released before the tests run (one
    of them loads its own through the CLI)."""
    engine = load_default_engine()
    generated = [
        {
            mode: engine.generate(
                engine.encode(prompt, chat=True),
                DecodeConfig(mode=mode, max_new_tokens=MAX_NEW_TOKENS),
            )
            for mode in ("target", "spd", "fly")
        }
        for prompt in PROMPTS
    ]
    del engine
    gc.collect()
    return generated


def test_spd_equals_the_target_token_for_token(results):
    for result in results:
        assert len(result["target"].token_ids) == MAX_NEW_TOKENS
        assert result["spd"].token_ids == result["target"].token_ids
        assert result["spd"].stats.loosely_accepted == 0


def test_fly_keeps_mismatches_loosely_and_raises_tau(results):
    assert sum(result["fly"].stats.loosely_accepted for result in results) > 0
    fly_rounds = sum(result["fly"].stats.num_rounds for result in results)
    spd_rounds = sum(result["spd"].stats.num_rounds for result in results)
    assert fly_rounds < spd_rounds  # the same number of tokens in fewer rounds: a higher tau
    assert all("def " in result["fly"].text for result in results)  # still answers


def test_the_library_gives_the_commands_tokens(results, capsys):
    """``Engine.load()`` runs the CLI's kernels (int8 draft, packed Linear layers, lean
    forward): FLy, whose output depends on the draft's numbers, emits the same tokens both ways."""
    import json

    from flyspec.cli import main

    loosened = [
        (prompt, result["fly"])
        for prompt, result in zip(PROMPTS, results, strict=True)
        if result["fly"].stats.loosely_accepted > 0  # the draft's numbers mattered
    ]
    assert loosened
    prompt, fly = loosened[0]
    command = ["generate", "--json", "--chat", prompt, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    command.append("--no-calibration")  # the library's defaults are the paper's rule
    assert main(command) == 0
    gc.collect()  # the command's own copy of the pair
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == fly.token_ids
