"""Shared fixtures: a saved tiny model pair, and the real default pair for end-to-end tests."""

import os

import pytest

from tests.tiny import save_tiny_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """``(draft_dir, target_dir)`` of a tiny random pair sharing one tokenizer."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


def load_default_engine():
    """The embedded default pair (draft 0.5B, target 1.5B) as the commands load it. Skipped
    where it is not installed, except in CI, where a missing pair is a failure. The caller
    releases it: one loaded pair at a time keeps the suite's memory at one pair's."""
    from flyspec.engine import Engine
    from flyspec.models import is_default_pair_installed

    if not is_default_pair_installed():
        message = "the default pair is not installed (run `flyspec models pull`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return Engine.load()


def pytest_terminal_summary(terminalreporter):
    """The peak resident memory of this test process, in every run's closing lines."""
    from flyspec.support.resident_memory import gib, peak_rss_bytes

    terminalreporter.write_line(
        f"peak resident memory of this test process: {gib(peak_rss_bytes())} GiB"
    )
