"""The llama.cpp backend on tiny random-weight GGUF files written in-process (float32 tensors,
so llama.cpp's logits follow transformers' closely): the forward against transformers', the KV
cache crop, the decoder and the engine on it, and the bench's llama.cpp methods."""

from __future__ import annotations

import sys

import pytest
import torch

from flyspec.bench import run_benchmark
from flyspec.bench.forward_cost import time_forwards
from flyspec.bench.prompts import BenchPrompt
from flyspec.config import DecodeConfig, LlamaCppConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.engine import Engine
from flyspec.errors import FlyspecError
from flyspec.models.llamacpp import LlamaCppLM
from flyspec.models.llamacpp_binding import require_llamacpp

VOCAB = 96
PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture
def target_lm(tiny_ggufs):
    lm = LlamaCppLM(tiny_ggufs[4], context=256, threads=1)
    yield lm
    lm.close()


def test_logits_follow_transformers(tiny_ggufs, target_lm):
    tokenizer, _, target, _, _ = tiny_ggufs
    ids = tokenizer.encode(PROMPT)
    logits = target_lm.logits(ids, 4)  # [4, V]
    with torch.no_grad():
        expected = target(torch.tensor([ids])).logits[0, -4:]
    assert logits.shape == (4, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=2e-2, rtol=0)
    assert target_lm.cached_tokens == ids


def test_a_cropped_cache_gives_the_logits_of_a_fresh_one(tiny_ggufs, target_lm):
    tokenizer = tiny_ggufs[0]
    ids = tokenizer.encode(PROMPT)
    first = ids + [5, 6, 7, 8]
    second = ids + [5, 9, 10]  # shares ids + [5]; 6, 7, 8 must leave the KV cache
    target_lm.logits(first, 5)
    cropped = target_lm.logits(second, 3)
    assert target_lm.cached_tokens == second
    target_lm.reset()
    assert target_lm.cached_tokens == []
    fresh = target_lm.logits(second, 3)
    torch.testing.assert_close(cropped, fresh, atol=1e-4, rtol=0)


def test_crop_keeps_a_prefix_and_refuses_to_grow(target_lm):
    target_lm.logits(list(range(10, 20)), 1)
    target_lm.runner.crop(4)
    assert target_lm.cached_tokens == list(range(10, 14))
    with pytest.raises(ValueError, match="cannot crop"):
        target_lm.runner.crop(5)
    assert target_lm.runner.length == 4


def test_forward_cost_times_the_llamacpp_runner_and_empties_it(target_lm):
    target_lm.logits([5, 6, 7], 1)
    times = time_forwards(target_lm, new_tokens=[1, 3], context_tokens=8, repeats=2, warmup=0)
    assert list(times) == ["llamacpp"]
    assert {n: len(samples) for n, samples in times["llamacpp"].items()} == {1: 2, 3: 2}
    assert target_lm.cached_tokens == [] and target_lm.runner.length == 0


def test_a_sequence_longer_than_the_context_is_refused(tiny_ggufs):
    lm = LlamaCppLM(tiny_ggufs[4], context=16, threads=1)
    assert lm.context_length >= 16  # llama.cpp may round the context up
    with pytest.raises(FlyspecError, match="do not fit llama.cpp's context"):
        lm.logits([5] * (lm.context_length + 1), 1)
    lm.close()


def test_bad_model_files_are_one_line_errors(tmp_path):
    with pytest.raises(FlyspecError, match="runs .gguf files"):
        LlamaCppLM(tmp_path / "model.safetensors")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    with pytest.raises(FlyspecError, match="could not load"):
        LlamaCppLM(broken)
    with pytest.raises(FlyspecError, match="at least 16"):
        LlamaCppLM(broken, context=4)


def test_a_missing_binding_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(FlyspecError, match=r"pip install 'flyspec\[llamacpp\]'"):
        require_llamacpp()


def test_the_config_checks_its_settings():
    with pytest.raises(FlyspecError, match="context"):
        LlamaCppConfig(context=8)
    with pytest.raises(FlyspecError, match="threads"):
        LlamaCppConfig(threads=-1)


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(mode="spd", k=4, max_new_tokens=40),
        DecodeConfig(mode="spd", drafter="mla", k=6, max_new_tokens=40),
        DecodeConfig(mode="spd", drafter="ngram", k=3, max_new_tokens=40),
        DecodeConfig(mode="spd", k=8, max_new_tokens=40, auto_k=True),
    ],
    ids=["spd", "mla", "ngram", "auto"],
)
def test_exact_speculative_decoding_on_llamacpp_equals_its_greedy_decoding(
    tiny_llamacpp_engine, config
):
    ids = tiny_llamacpp_engine.encode(PROMPT)
    target = tiny_llamacpp_engine.generate(ids, config.with_updates(mode="target"))
    speculative = tiny_llamacpp_engine.generate(ids, config)
    assert speculative.token_ids == target.token_ids
    assert len(target.token_ids) > 0
    assert max(r.drafted for r in speculative.stats.rounds) <= config.k


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(mode="spd", drafter="ngram", k=6, max_new_tokens=40),
        DecodeConfig(mode="spd", k=6, max_new_tokens=40, auto_k=True),
    ],
    ids=["ngram", "model-auto"],
)
def test_a_prediction_on_llamacpp_keeps_its_greedy_text(tiny_llamacpp_engine, config):
    """Predicted Outputs on llama.cpp's forwards: a prediction with two tokens changed gives
    the target's greedy tokens, with prompt lookup or the draft model behind it."""
    ids = tiny_llamacpp_engine.encode(PROMPT)
    greedy = tiny_llamacpp_engine.generate(ids, config.with_updates(mode="target")).token_ids
    prediction = greedy[:12] + [greedy[12] + 1, greedy[13] + 1] + greedy[14:]
    predicted = tiny_llamacpp_engine.generate(ids, config, prediction=prediction)
    assert predicted.token_ids == greedy
    assert predicted.stats.accepted_prediction_tokens > 0


def test_the_engine_on_llamacpp_names_its_backend_and_ends_at_eos(tiny_llamacpp_engine, tiny_ggufs):
    assert tiny_llamacpp_engine.backend == "llamacpp"
    assert tiny_llamacpp_engine.kernels["backend"] == "llamacpp"
    assert tiny_llamacpp_engine.kernels["threads"] == 1
    assert tiny_llamacpp_engine.context_length == 512
    assert tiny_llamacpp_engine.target_model is None
    assert tiny_ggufs[0].eos_token_id in tiny_llamacpp_engine.decoder.eos_token_ids
    result = tiny_llamacpp_engine.generate(PROMPT, DecodeConfig(mode="fly", k=5, max_new_tokens=12))
    assert len(result.token_ids) <= 12
    assert result.stats.finish_reason in ("length", "stop")


def test_fly_on_llamacpp_runs_the_same_rule_as_on_torch(tiny_ggufs, tiny_llamacpp_engine):
    """The same tiny pair on both backends: FLy's verdicts read logits that agree to ~1e-3,
    so the committed tokens agree (the tiny models' logits are far apart)."""
    tokenizer, draft, target, _, _ = tiny_ggufs
    on_torch = SpeculativeDecoder(target, draft, eos_token_ids={tokenizer.eos_token_id})
    ids = tokenizer.encode(PROMPT)
    config = DecodeConfig(mode="fly", k=5, max_new_tokens=30)
    expected = [event.token for event in on_torch.stream(ids, config)]
    assert [event.token for event in tiny_llamacpp_engine.decoder.stream(ids, config)] == expected


def test_the_bench_runs_llamacpp_beside_its_own_decoding(tiny_llamacpp_engine):
    prompts = [BenchPrompt(id="a", raw=PROMPT), BenchPrompt(id="b", raw="for x in")]
    config = DecodeConfig(k=4, max_new_tokens=10)
    report = run_benchmark(
        None,
        prompts,
        ["llamacpp-target", "llamacpp-spd", "llamacpp-fly@auto", "llamacpp-ngram@2"],
        config,
        progress=False,
        llamacpp_engine=tiny_llamacpp_engine,
        baseline="llamacpp-target",
    )
    summaries = {s["method"]: s for s in report["methods"]}
    assert list(summaries) == [
        "llamacpp-target",
        "llamacpp-spd",
        "llamacpp-fly@auto",
        "llamacpp-ngram@2",
    ]
    assert summaries["llamacpp-spd"]["identical_to_target"] == 2
    assert (
        summaries["llamacpp-spd"]["speedup_over_llamacpp"] == summaries["llamacpp-spd"]["speedup"]
    )
    assert summaries["llamacpp-fly@auto"]["settings"]["k"] == "auto"
    assert summaries["llamacpp-ngram@2"]["settings"]["k"] == 2
    assert "tau" not in summaries["llamacpp-target"]
    assert report["config"]["baseline"] == "llamacpp-target"
    target = summaries["llamacpp-target"]
    assert target["decode_speedup_over_llamacpp"] == pytest.approx(1.0)
    for record in report["samples"]["llamacpp-target"]:
        assert 0 < record["prefill_seconds"] < record["seconds"]


def test_the_commands_run_on_gguf_files(capsys, monkeypatch, tmp_path, tiny_ggufs):
    import json

    from flyspec.cli import main

    monkeypatch.setenv("FLYSPEC_HOME", str(tmp_path / "home"))
    _, _, _, draft_path, target_path = tiny_ggufs
    pair = ["--target", str(target_path), "--draft", str(draft_path), "--llamacpp-threads", "1"]
    code = main(
        ["generate", "--backend", "llamacpp", *pair, "--json", "-k", "auto", "def fibonacci("]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["stats"]["emitted"] > 0
    assert "loaded on llama.cpp" in captured.err
    assert (tmp_path / "home" / "tokenizers").is_dir()  # read from the GGUF once, kept

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "def fibonacci(n):"}) + "\n")
    output = tmp_path / "bench"
    code = main(
        [
            "bench",
            *pair,
            "--prompts-file",
            str(prompts),
            "--no-chat",
            "--max-new-tokens",
            "8",
            "--methods",
            "llamacpp-target,llamacpp-spd@3,llamacpp-fly@auto",
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((output / "bench.json").read_text())
    assert report["config"]["baseline"] == "llamacpp-target"
    assert [s["method"] for s in report["methods"]] == [
        "llamacpp-target",
        "llamacpp-spd@3",
        "llamacpp-fly@auto",
    ]
    assert "| llamacpp-spd@3 |" in captured.out


@pytest.fixture
def crashing_binding(tmp_path):
    """The environment of a process whose ``llama_cpp`` crashes on its first call into the
    library (what a binding built for a CPU feature that faults does), with a fresh
    ``$FLYSPEC_HOME``."""
    import os

    package = tmp_path / "crashing" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import ctypes\n\n\n"
        "def __getattr__(name):\n"
        "    if name.startswith('__'):\n"
        "        raise AttributeError(name)\n"
        "    return lambda *args: ctypes.string_at(0)  # reads address 0: SIGSEGV\n"
    )
    return {
        **os.environ,
        "PYTHONPATH": str(package.parent),
        "FLYSPEC_HOME": str(tmp_path / "home"),
    }


def test_a_binding_that_crashes_stops_with_one_line_that_names_the_fix(
    crashing_binding, tiny_ggufs
):
    import subprocess

    _, _, _, draft_path, target_path = tiny_ggufs
    command = [sys.executable, "-m", "flyspec.cli", "generate", "--backend", "llamacpp"]
    command += ["--target", str(target_path), "--draft", str(draft_path), "def fibonacci("]
    result = subprocess.run(
        command, env=crashing_binding, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("flyspec: error: llama.cpp's binding")
    assert "cannot decode on this CPU" in last and "killed by SIGSEGV" in last
    assert "scripts/install_llamacpp.sh" in last and "-mno-amx-tile" in last

    doctor = subprocess.run(
        [sys.executable, "-m", "flyspec.cli", "doctor"],
        env=crashing_binding,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert doctor.returncode == 1
    line = next(line for line in doctor.stdout.splitlines() if "llama.cpp" in line)
    assert line.startswith("fails") and "killed by SIGSEGV" in line
    assert "fix: scripts/install_llamacpp.sh" in doctor.stdout


def test_the_decode_check_is_kept_per_build_and_cpu(tmp_path):
    from flyspec.models.llamacpp_binding import check_decoding, verdict_path

    home = tmp_path / "home"
    verdict = check_decoding(home=home)
    assert verdict.ok, verdict.describe()
    path = verdict_path(home)
    assert path.is_file()
    path.write_text(path.read_text().replace('"ok": true', '"ok": false'))
    assert not check_decoding(home=home).ok  # read from the record, not checked again
    assert check_decoding(home=home, recheck=True).ok


def test_the_bindings_prompt_lookup_runs_a_prompt_longer_than_a_batch(tiny_ggufs):
    """The binding keeps every position's logits with a draft model, in a buffer it sizes
    for one batch (512) unless told: a longer prompt overran it."""
    tokenizer, _, _, draft_path, target_path = tiny_ggufs
    engine = Engine(
        target_model=LlamaCppLM(target_path, context=1024, threads=1),
        draft_model=LlamaCppLM(draft_path, context=1024, threads=1),
        tokenizer=tokenizer,
        target_name=str(target_path),
        draft_name=str(draft_path),
    )
    prompt = BenchPrompt(id="long", raw="for i in range(10):\n    print(i)\n" * 30)
    assert len(tokenizer.encode(prompt.raw)) > 512
    report = run_benchmark(
        None,
        [prompt],
        ["llamacpp-target", "llamacpp-lookup"],
        DecodeConfig(k=4, max_new_tokens=24),
        progress=False,
        llamacpp_engine=engine,
        baseline="llamacpp-target",
    )
    assert report["failed_methods"] == []
    lookup = report["methods"][1]
    assert lookup["method"] == "llamacpp-lookup" and lookup["identical_to_target"] == 1
