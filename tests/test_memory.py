"""Resident memory: the engine holds each weight once (flyspec.models.pages), and the figures
bench and generate report (flyspec.support.resident_memory)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flyspec.models.checkpoint import checkpoint_parameters
from flyspec.support.resident_memory import PeakRss, gib, tree_rss_bytes
from tests.tiny import make_tiny_tokenizer

LOAD_AND_MEASURE = textwrap.dedent(
    """
    import json, os, sys
    import transformers.models.qwen2.modeling_qwen2  # imports count before, not as weights
    from flyspec import DecodeConfig
    from flyspec.engine import Engine
    from flyspec.support.resident_memory import peak_rss_bytes, rss_bytes
    import flyspec.models.kernels, flyspec.models.lean
    before = rss_bytes(os.getpid())
    engine = Engine.load(target=sys.argv[1], with_draft=False)
    engine.generate(engine.encode("a b"), DecodeConfig(mode="target", max_new_tokens=2))
    print(json.dumps({"grew": peak_rss_bytes() - before, "kernels": engine.kernels}))
    """
)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A random Qwen2 of about 300 MB of float32 Linear weights (its file), and their bytes."""
    folder = tmp_path_factory.mktemp("wide-model")
    tokenizer = make_tiny_tokenizer(96)
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    weights = sum(p.nbytes for p in model.parameters())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, weights


def test_loading_with_packed_kernels_holds_the_weights_once(wide_model):
    """The peak of a process over Engine.load with the default kernels (oneDNN-packed float32
    layers) and a generation: one that held the original weights beside their packed copies,
    or mapped the file and then packed from it, peaks at about twice the weights."""
    folder, weights = wide_model
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_MEASURE, str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["kernels"]["target_packed_layers"] > 0  # packed where oneDNN exists
    assert measured["grew"] < 1.4 * weights, (
        f"loading grew the process by {gib(measured['grew'])} GiB for {gib(weights)} GiB of weights"
    )


def test_the_peak_watch_sees_a_child_process():
    # Longer than the watch's look for new processes (PROCESS_SCAN_SECONDS).
    child = "x = bytearray(200 * 2**20); import time; time.sleep(2.5)"
    with PeakRss() as watch:
        subprocess.run([sys.executable, "-c", child], check=True)
    assert watch.peak_bytes >= tree_rss_bytes() + 150 * 2**20


def test_checkpoint_parameters_come_from_the_file_headers(wide_model):
    folder, weights = wide_model
    assert checkpoint_parameters(folder) * 4 == weights
    assert checkpoint_parameters(folder / "nothing-here") is None


def test_the_memory_a_piece_of_work_touched_leaves_out_what_the_process_only_holds():
    """Two methods of one bench share a process: each run's own memory is what it read or
    wrote, not what the other's models hold."""
    import os

    import numpy as np

    from flyspec.support.resident_memory import forget_touched, touched_bytes

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("Linux's clear_refs is not writable here")
    held = np.ones(96 * 2**20 // 8)  # 96 MiB resident, not used below
    forget_touched()
    used = np.ones(32 * 2**20 // 8)
    used += 1
    touched = touched_bytes()
    assert 32 * 2**20 <= touched < 80 * 2**20
    assert held.sum() > 0
