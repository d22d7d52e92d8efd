"""The plugin inside real vLLM engines (CPU build) on the embedded default pair.

Each engine takes about a minute to start, so the engines of the greedy checks are started once
per session, one after another (never two at a time: memory), and the tests read what they
produced.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from flyspec.bench.prompts import dataset_prompts, encode_prompts
from flyspec.config import FlyConfig
from flyspec.integrations.vllm import additional_config
from flyspec.integrations.vllm.engine import read_spec_decode_stats
from flyspec.integrations.vllm.launch import VllmEngineSpec, engine_environment
from flyspec.models import default_pair_paths, load_tokenizer
from tests.vllm.cpu import needs_avx512

K = 15
MAX_TOKENS = 128
PAIR = default_pair_paths()


@dataclass
class EngineRun:
    outputs: list[list[int]]
    stats: object  # flyspec.integrations.vllm.engine.VllmStats


def engine(additional: dict | None, **overrides) -> LLM:
    spec = VllmEngineSpec(
        target=str(PAIR.target), draft=str(PAIR.draft), mode="spd", k=K, max_model_len=2048
    )
    kwargs = spec.llm_kwargs()
    if additional is not None:
        kwargs["additional_config"] = additional
    kwargs.update(overrides)
    os.environ.update(engine_environment(os.environ))
    return LLM(**kwargs)


def close(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def prompts_ids() -> list[list[int]]:
    # HumanEval answers are short (about 50 tokens); eight of them give FLy's defaults enough
    # rounds to loosen a few tokens (about 1.4% of the drafted ones on the default pair).
    prompts = dataset_prompts("humaneval", limit=8, chat=True)
    return encode_prompts(load_tokenizer(str(PAIR.target)), prompts)


def greedy_run(additional: dict | None, prompts_ids) -> EngineRun:
    # One request at a time: with several in flight the batch's composition, and with it the
    # bfloat16 rounding, depends on timing, and two engines need not agree token for token.
    llm = engine(additional, max_num_seqs=1)
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts_ids],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            use_tqdm=False,
        )
        return EngineRun(
            [list(o.outputs[0].token_ids) for o in outputs], read_spec_decode_stats(llm)
        )
    finally:
        close(llm)


@pytest.fixture(scope="session")
def greedy_runs(prompts_ids) -> dict[str, EngineRun]:
    """vLLM's own exact verification, the plugin's path with a rule that never loosens, and
    FLy's defaults, on the same prompts."""
    never_loosen = {"flyspec": {"fly_entropy_threshold": 1e9}}
    return {
        "standard": greedy_run(None, prompts_ids),
        "never": greedy_run(never_loosen, prompts_ids),
        "fly": greedy_run(additional_config(FlyConfig()), prompts_ids),
    }


@needs_avx512
def test_the_plugin_path_without_loosening_equals_vllm(greedy_runs):
    assert greedy_runs["never"].outputs == greedy_runs["standard"].outputs
    assert greedy_runs["never"].stats.loosely_accepted == 0


@needs_avx512
def test_fly_accepts_more_and_counts_what_it_loosened(greedy_runs):
    standard, fly = greedy_runs["standard"].stats, greedy_runs["fly"].stats
    assert fly.loosely_accepted > 0
    tau_fly = fly.as_dict()["tau"]
    tau_standard = standard.as_dict()["tau"]
    assert tau_fly > tau_standard
    assert standard.loosely_accepted == 0


@needs_avx512
def test_mixed_temperatures_keep_every_token_inside_top_k(prompts_ids):
    """Eight requests, greedy and sampled at several temperatures, top-k 5, in one batch:
    every token a sampled request emits is among the target's 5 most likely, so none has
    probability zero under top-k, even where FLy kept it loosely. (vLLM drops top-k from
    greedy requests: there the rule is FLy's greedy one.) A token tied with the 5th is inside
    top-k too, so the check compares logprobs: vLLM's rank counts ties as greater."""
    llm = engine(additional_config(FlyConfig()), max_num_seqs=8)
    try:
        prompts = [
            TokensPrompt(prompt_token_ids=prompts_ids[i % len(prompts_ids)]) for i in range(8)
        ]
        temperatures = [0.0, 0.5, 1.0, 1.5, 0.0, 0.7, 1.0, 2.0]
        params = [
            SamplingParams(temperature=t, top_k=5, max_tokens=64, seed=i, logprobs=5)
            for i, t in enumerate(temperatures)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = read_spec_decode_stats(llm)
    finally:
        close(llm)
    assert len(outputs) == 8
    for output, temperature in zip(outputs, temperatures, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids
        if temperature == 0:
            continue
        for token, position_logprobs in zip(completion.token_ids, completion.logprobs, strict=True):
            fifth_best = sorted((e.logprob for e in position_logprobs.values()), reverse=True)[4]
            assert position_logprobs[token].logprob >= fifth_best
    assert stats.rounds > 0


ENGINE_WITH_BAD_SETTINGS = """
from vllm import LLM
if __name__ == "__main__":
    LLM(model={target!r}, enforce_eager=True, max_model_len=512,
        speculative_config={{"method": "ngram", "num_speculative_tokens": 4}},
        additional_config={{"flyspec": {{"fly_window_size": -1}}}})
"""


def test_bad_settings_stop_the_engine_start_with_one_line(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(ENGINE_WITH_BAD_SETTINGS.format(target=str(PAIR.target)))
    started = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_environment(os.environ),
    )
    assert started.returncode != 0
    # vLLM logs the worker's traceback to standard output; its last line is the plugin's.
    assert (
        "VllmPluginError: bad additional_config['flyspec']: window must be an integer >= 0, "
        "got -1" in started.stdout + started.stderr
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--window", "-1"], "window must be an integer >= 0, got -1"),
        (
            ["--drafter", "mla"],
            "vLLM's proposers here are model, ngram; the 'mla' drafter runs in flyspec's own "
            "engine only",
        ),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    ],
)
def test_bad_serve_flags_are_one_line_errors(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "flyspec.cli", "serve", "--engine", "vllm", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"flyspec: error: {message}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_predictions_through_vllms_middleware_option():
    from flyspec.integrations.vllm.predictions import MIDDLEWARE

    printed = subprocess.run(
        [sys.executable, "-m", "flyspec.cli", "serve", "--engine", "vllm", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert printed.returncode == 0, printed.stderr
    assert f"--middleware {MIDDLEWARE}" in printed.stdout


@needs_avx512
def test_serve_answers_an_openai_chat_request_and_publishes_the_count(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flyspec.cli",
                "serve",
                "--engine",
                "vllm",
                "--port",
                str(port),
                "--max-new-tokens",
                "48",
                "--max-model-len",
                "2048",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the server did not start in 300 s")
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "messages": [
                    {"role": "user", "content": "Write a Python function that reverses a list."}
                ]
            },
            timeout=300,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 48
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert re.search(r"^vllm:spec_decode_num_loosely_accepted_tokens_total \d", metrics, re.M)
        assert "vllm:spec_decode_num_drafts_total" in metrics
        predicted = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Reverse a list."}],
                "prediction": {"type": "content", "content": "def reverse(items):"},
            },
            timeout=60,
        )
        assert predicted.status_code == 400, predicted.text
        assert "vLLM has no Predicted Outputs" in predicted.json()["error"]["message"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@needs_avx512
def test_fly_runs_with_the_ngram_proposer(prompts_ids):
    """Prompt-lookup drafts (no draft model, variable-length proposals): greedy and sampled
    requests complete with FLy on, and the speculative rounds ran."""
    llm = engine(
        additional_config(FlyConfig()),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        },
        max_num_seqs=4,
    )
    try:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompts_ids[:4]]
        params = [
            SamplingParams(temperature=t, top_k=20, max_tokens=64, seed=i)
            for i, t in enumerate([0.0, 0.0, 0.8, 1.0])
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = read_spec_decode_stats(llm)
    finally:
        close(llm)
    assert all(output.outputs[0].token_ids for output in outputs)
    assert stats.rounds > 0 and stats.drafted > 0
