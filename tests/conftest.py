"""Shared fixtures: a saved tiny model pair, and the real default pair for end-to-end tests."""

import os

import pytest
import torch

from tests.tiny import make_tiny_model, make_tiny_tokenizer, save_tiny_gguf, save_tiny_pair

GGUF_VOCAB = 96
DECODE_VOCAB = 64


@pytest.fixture(scope="module")
def target():
    """A tiny random float64 target of vocabulary :data:`DECODE_VOCAB`, for the decoding
    tests (float64: forwards of any size agree, so exact decoding gives its greedy tokens)."""
    return make_tiny_model(vocab_size=DECODE_VOCAB, seed=1, dtype=torch.float64)


@pytest.fixture(scope="module")
def draft():
    """A tiny random float64 draft, of the target's vocabulary and another seed."""
    return make_tiny_model(vocab_size=DECODE_VOCAB, seed=2, dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """``(draft_dir, target_dir)`` of a tiny random pair sharing one tokenizer."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory):
    """A tiny random pair as float32 GGUF files for llama.cpp: ``(tokenizer, draft model,
    target model, draft GGUF, target GGUF)``."""
    folder = tmp_path_factory.mktemp("gguf")
    tokenizer = make_tiny_tokenizer(GGUF_VOCAB)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    draft = make_tiny_model(vocab_size=GGUF_VOCAB, seed=1, num_layers=1, **ids)
    target = make_tiny_model(vocab_size=GGUF_VOCAB, seed=2, num_layers=2, **ids)
    draft_path = save_tiny_gguf(folder / "draft.gguf", draft, tokenizer)
    target_path = save_tiny_gguf(folder / "target.gguf", target, tokenizer)
    return tokenizer, draft, target, draft_path, target_path


@pytest.fixture(scope="module")
def tiny_llamacpp_engine(tiny_ggufs):
    """An :class:`~flyspec.engine.Engine` on llama.cpp over the tiny GGUF pair (one per test
    module: what ``-k auto`` learns stays in its module)."""
    from flyspec.engine import Engine
    from flyspec.models.llamacpp import LlamaCppLM

    tokenizer, _, _, draft_path, target_path = tiny_ggufs
    return Engine(
        target_model=LlamaCppLM(target_path, context=512, threads=1),
        draft_model=LlamaCppLM(draft_path, context=512, threads=1),
        tokenizer=tokenizer,
        target_name=str(target_path),
        draft_name=str(draft_path),
    )


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


@pytest.fixture(scope="module")
def loose_client():
    """The openai client of a tiny pair whose draft differs from the target (FLy keeps some
    tokens loosely), served with room for 600 new tokens: JSON answers of random models end
    within it, their whitespace bounded (decoding/grammar.py)."""
    from tests.test_server import loosening_engine, openai_client

    with openai_client(loosening_engine(), max_new_tokens=600) as client:
        yield client
