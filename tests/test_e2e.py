"""End to end on the real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B), greedy.

About two to three minutes on 2 CPU cores: the target alone makes ~3 tokens/s.
"""

import pytest

from flyspec.config import DecodeConfig

pytestmark = pytest.mark.e2e

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def results(default_engine):
    prompt_ids = default_engine.encode(PROMPT, chat=True)
    return {
        mode: default_engine.generate(
            prompt_ids, DecodeConfig(mode=mode, max_new_tokens=MAX_NEW_TOKENS)
        )
        for mode in ("target", "spd", "fly")
    }


def test_spd_equals_the_target_token_for_token(results):
    assert len(results["target"].token_ids) == MAX_NEW_TOKENS
    assert results["spd"].token_ids == results["target"].token_ids
    assert results["spd"].stats.loosely_accepted == 0


def test_fly_keeps_mismatches_loosely_and_raises_tau(results):
    fly, spd = results["fly"].stats, results["spd"].stats
    assert fly.loosely_accepted > 0
    assert fly.tau > spd.tau
    assert "def " in results["fly"].text  # still an answer to the question


def test_the_library_gives_the_commands_tokens(results, capsys):
    """``Engine.load()`` runs the CLI's kernels (int8 draft, packed Linear layers, lean
    forward): FLy, whose output depends on the draft's numbers, emits the same tokens both ways."""
    import gc
    import json

    from flyspec.cli import main

    assert results["fly"].stats.loosely_accepted > 0  # the draft's numbers mattered
    command = ["generate", "--json", "--chat", PROMPT, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    assert main(command) == 0
    gc.collect()  # the command's own copy of the pair
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == results["fly"].token_ids
