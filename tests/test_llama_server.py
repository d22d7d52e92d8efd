"""llama.cpp's own server as a bench peer: the child process (started, waited for, always
stopped, a failed start in one line), the options each method passes, and the real llama-server
(built by scripts/setup.sh --llamacpp) on the tiny GGUF pair beside the binding's decoding."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flyspec.bench import reference_method, run_benchmark
from flyspec.bench.llama_server import (
    LLAMA_SERVER_METHODS,
    ServerSetup,
    llama_server_binary,
    server_arguments,
)
from flyspec.bench.methods import make_method, method_block, parse_methods
from flyspec.bench.prompts import BenchPrompt
from flyspec.bench.report import markdown_table
from flyspec.cli.bench import _baseline
from flyspec.config import DecodeConfig
from flyspec.errors import FlyspecError
from flyspec.support.child_server import ChildServer

PROMPT = "def fibonacci(n):\n    return"

HEALTHY_SERVER = textwrap.dedent(
    """
    import http.server, sys
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def python_child(code: str):
    return lambda port: [sys.executable, "-c", code, str(port)]


def test_a_child_server_is_waited_for_and_stopped():
    server = ChildServer("a test server", python_child(HEALTHY_SERVER), start_seconds=30)
    with server as started:
        assert started.process.poll() is None
    assert server.process.poll() is not None
    server.stop()  # a second stop is harmless


def test_a_child_that_exits_says_why_in_one_line():
    failing = "import sys; print('loading'); print('error: no such model file'); sys.exit(3)"
    server = ChildServer("a test server", python_child(failing), start_seconds=30)
    with pytest.raises(FlyspecError, match="exited with status 3.*no such model file") as error:
        server.start()
    assert "\n" not in str(error.value)
    assert server.process.poll() is not None


def test_a_child_that_never_answers_is_stopped():
    silent = "import time; print('still loading', flush=True); time.sleep(60)"
    server = ChildServer("a test server", python_child(silent), start_seconds=1)
    with pytest.raises(FlyspecError, match="did not answer /health within 1 s: still loading"):
        server.start()
    assert server.process.poll() is not None


def test_a_missing_binary_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYSPEC_LLAMA_SERVER", str(tmp_path / "nothing"))
    with pytest.raises(FlyspecError, match="FLYSPEC_LLAMA_SERVER=.* is not an executable"):
        llama_server_binary()
    monkeypatch.delenv("FLYSPEC_LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FlyspecError, match="scripts/setup.sh --llamacpp"):
        llama_server_binary()


def test_each_method_passes_its_speculation_options():
    setup = ServerSetup(target="t.gguf", draft="d.gguf", threads=2, context=4096, batch=512)
    plain = server_arguments("llama-server", setup, k=7)
    assert "--spec-type" not in plain and "--spec-draft-model" not in plain
    assert plain[plain.index("--threads") + 1] == "2"
    assert plain[plain.index("--ctx-size") + 1] == "4096"
    assert plain[plain.index("--parallel") + 1] == "1"
    mod = server_arguments("llama-server-ngram-mod", setup, k=7)
    assert mod[mod.index("--spec-type") + 1] == "ngram-mod"
    assert "--spec-draft-n-max" not in mod  # ngram-mod sizes its own drafts
    simple = server_arguments("llama-server-ngram-simple", setup, k=7)
    assert simple[simple.index("--spec-type") + 1] == "ngram-simple"
    assert simple[simple.index("--spec-draft-n-max") + 1] == "7"
    draft = server_arguments("llama-server-draft", setup, k=7)
    assert draft[draft.index("--spec-draft-model") + 1] == "d.gguf"
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "7"
    with pytest.raises(FlyspecError, match="needs the draft model's GGUF"):
        server_arguments("llama-server-draft", ServerSetup(target="t.gguf"), k=7)


def test_the_server_is_the_baseline_and_its_rows_come_first():
    assert _baseline("llamacpp-fly,llama-server-ngram-mod", vllm_engine=False) == "llama-server"
    assert _baseline("llamacpp-fly", vllm_engine=False) == "llamacpp-target"
    assert _baseline("fly,llama-server", vllm_engine=False) == "target"
    names = parse_methods(
        "llamacpp-target,llamacpp-predict@auto,llama-server-ngram-mod", baseline="llama-server"
    )
    assert names == [
        "llama-server",
        "llama-server-ngram-mod",
        "llamacpp-target",
        "llamacpp-predict@auto",
    ]
    assert method_block("llama-server-draft@4") == 4
    with pytest.raises(FlyspecError, match="drafts nothing"):
        method_block("llama-server@4")
    every = ["target", "llama-server", "llamacpp-target"]
    assert reference_method("llama-server-draft", every, "target") == "llama-server"
    assert reference_method("llamacpp-fly", every, "target") == "llamacpp-target"
    assert reference_method("fly", every, "target") == "target"


def test_the_table_shows_speedups_over_each_plain_llamacpp():
    row = {
        "method": "llamacpp-fly",
        "tokens_per_second": 10.0,
        "speedup": 1.2,
        "identical_to_target": 1,
        "samples": 1,
        "speedup_over_llama_server": 1.2,
        "decode_speedup_over_llama_server": 1.3,
        "speedup_over_llamacpp": 1.25,
        "decode_speedup_over_llamacpp": 1.35,
    }
    header = markdown_table([row], baseline="llama-server").splitlines()[0]
    columns = [title.strip() for title in header.strip("|").split("|")]
    assert columns[-3:] == [
        "decoding over llama-server",  # the speedup over it is the baseline's column
        "over llamacpp-target",
        "decoding over llamacpp-target",
    ]
    assert (
        markdown_table([row], baseline="llama-server")
        .splitlines()[2]
        .endswith("| 1.30x | 1.25x | 1.35x |")
    )


# The real llama-server on the tiny GGUF pair. It is built by scripts/setup.sh --llamacpp, which
# CI runs: there a missing binary fails.


@pytest.fixture(scope="module")
def llama_server():
    try:
        return llama_server_binary()
    except FlyspecError as error:
        if os.environ.get("CI"):
            pytest.fail(str(error))
        pytest.skip(str(error))


def test_the_binary_runs_here(llama_server):
    done = subprocess.run([llama_server, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_bench_sets_llamacpp_beside_its_server(llama_server, tiny_llamacpp_engine):
    prompts = [BenchPrompt(id="a", raw=PROMPT), BenchPrompt(id="b", raw="for x in")]
    config = DecodeConfig(k=4, max_new_tokens=12)
    names = [
        "llama-server",
        "llama-server-ngram-mod",
        "llama-server-ngram-simple@3",
        "llama-server-draft",
        "llamacpp-target",
        "llamacpp-spd",
    ]
    report = run_benchmark(
        None,
        prompts,
        names,
        config,
        progress=False,
        llamacpp_engine=tiny_llamacpp_engine,
        baseline="llama-server",
    )
    assert running_llama_servers() == []  # every server stopped
    assert report["failed_methods"] == []
    summaries = {s["method"]: s for s in report["methods"]}
    assert list(summaries) == names
    server = summaries["llama-server"]
    assert server["kind"] == "llama-server" and server["speedup"] == pytest.approx(1.0)
    assert server["settings"]["threads"] == 1
    assert summaries["llama-server-ngram-simple@3"]["settings"]["k"] == 3
    assert summaries["llama-server-draft"]["settings"]["k"] == 4
    # One llama.cpp, the same greedy tokens: by its server (lossless speculation included)
    # and by its binding.
    for name in names:
        assert summaries[name]["identical_to_target"] == 2, name
        assert summaries[name]["identical_to"] == (
            "llamacpp-target" if name.startswith("llamacpp-") else "llama-server"
        )
    server_tokens = [r["token_ids"] for r in report["samples"]["llama-server"]]
    binding_tokens = [r["token_ids"] for r in report["samples"]["llamacpp-target"]]
    assert server_tokens == binding_tokens
    assert all(len(tokens) > 0 for tokens in server_tokens)
    assert summaries["llamacpp-spd"]["speedup_over_llama_server"] == pytest.approx(
        summaries["llamacpp-spd"]["speedup"]
    )
    assert summaries["llama-server-draft"]["drafted"] > 0
    for record in report["samples"]["llama-server"]:
        assert 0 < record["prefill_seconds"] < record["seconds"]
        assert record["server_timings"]["predicted_n"] >= record["new_tokens"]


def test_a_server_that_does_not_start_leaves_the_others_running(
    llama_server, tiny_llamacpp_engine, tmp_path, capsys
):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    draft = tiny_llamacpp_engine.decoder.draft
    original = draft.runner.path
    draft.runner.path = broken  # llama-server-draft is handed a file it cannot load
    try:
        report = run_benchmark(
            None,
            [BenchPrompt(id="a", raw=PROMPT)],
            ["llama-server", "llama-server-draft", "llamacpp-target"],
            DecodeConfig(k=4, max_new_tokens=6),
            progress=False,
            llamacpp_engine=tiny_llamacpp_engine,
            baseline="llama-server",
        )
    finally:
        draft.runner.path = original
    (failure,) = report["failed_methods"]
    assert failure["method"] == "llama-server-draft"
    assert "during loading" in failure["reason"] and "exited with status" in failure["reason"]
    assert [s["method"] for s in report["methods"]] == ["llama-server", "llamacpp-target"]
    assert "llama-server-draft failed during loading" in capsys.readouterr().err


def test_a_bench_that_fails_stops_every_server(llama_server, tiny_llamacpp_engine, monkeypatch):
    from flyspec.bench.llama_server import LlamaServerMethod

    def refuse(self, body, **_):
        raise FlyspecError(f"{self.name} answered 500: a test's refusal")

    monkeypatch.setattr(LlamaServerMethod, "request", refuse)
    with pytest.raises(FlyspecError, match="the baseline llama-server failed.*a test's refusal"):
        run_benchmark(
            None,
            [BenchPrompt(id="a", raw=PROMPT)],
            ["llama-server", "llama-server-ngram-mod"],
            DecodeConfig(k=4, max_new_tokens=6),
            progress=False,
            llamacpp_engine=tiny_llamacpp_engine,
            baseline="llama-server",
        )
    assert running_llama_servers() == []


def test_a_method_stops_its_server(llama_server, tiny_llamacpp_engine):
    method = make_method(
        "llama-server-ngram-mod",
        None,
        DecodeConfig(max_new_tokens=4),
        llamacpp_engine=tiny_llamacpp_engine,
    )
    assert set(LLAMA_SERVER_METHODS) >= {"llama-server-ngram-mod"}
    run = method.run([1, 2, 3, 4], max_new_tokens=4, seed=None)
    assert 0 < len(run.token_ids) <= 4
    method.close()
    assert method.server.process.poll() is not None


def test_the_quick_start_comparison_times_llama_server_first_and_stops_it(
    llama_server, capsys, monkeypatch, tmp_path, tiny_ggufs
):
    import json

    from flyspec.cli import main

    monkeypatch.setenv("FLYSPEC_HOME", str(tmp_path / "home"))
    _, _, _, draft_path, target_path = tiny_ggufs
    pair = ["--model", str(target_path), "--draft-model", str(draft_path), "--threads", "1"]
    command = ["bench", "--methods", "llamacpp-fly", *pair, "--json", "--max-tokens", "6"]
    code = main([*command, "--repeats", "1", "--prompt", "def fibonacci("])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    payload = json.loads(captured.out)
    assert len(payload["llama_server_tokens_per_second"]) == 1
    assert len(payload["llamacpp_tokens_per_second"]) == 1
    assert payload["llama_server_weights"] == target_path.name
    assert running_llama_servers() == []  # stopped


def running_llama_servers() -> list[int]:
    """The pids of this process's children that run llama-server."""
    from pathlib import Path

    from flyspec.support.machine import running_children

    found = []
    for pid in running_children():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if b"llama-server" in command:
            found.append(pid)
    return found


def test_the_doctor_says_whether_llama_server_runs(monkeypatch, tmp_path):
    from flyspec.cli.doctor import check_llama_server

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 1 (build 1, commit abc)' >&2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLYSPEC_LLAMA_SERVER", str(fake))
    finding = check_llama_server()
    assert finding.status == "ok" and "version: 1 (build 1, commit abc)" in finding.detail
    fake.write_text("#!/bin/sh\necho 'illegal instruction' >&2\nexit 132\n")
    finding = check_llama_server()
    assert finding.status == "fails" and "illegal instruction" in finding.detail
    monkeypatch.setenv("FLYSPEC_LLAMA_SERVER", str(tmp_path / "nothing"))
    assert check_llama_server().status == "fails"
    monkeypatch.delenv("FLYSPEC_LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    finding = check_llama_server()
    assert finding.status == "missing", finding
    assert "scripts/setup.sh --llamacpp" in finding.fix
