"""The command line: one-line errors for bad input, and generate end to end on a tiny pair."""

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from flyspec.cli import main
from tests.tiny import make_tiny_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory):
    """A model whose tokenizer differs from the tiny pair's."""
    folder = tmp_path_factory.mktemp("other-vocab")
    tokenizer = make_tiny_tokenizer(100, seed_words=("while", "class"))
    make_tiny_model(vocab_size=100, seed=9).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, fragment):
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("flyspec: error:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "x", "-k", "0"], "k must be"),
        (["generate", "x", "--window", "-1"], "window must be"),
        (["generate", "x", "--theta", "-0.5"], "theta must be"),
        (["generate", "x", "--temperature", "-1"], "temperature must be"),
        (["generate", "x", "--max-new-tokens", "0"], "max_new_tokens must be"),
        (["generate", "x", "--drafter", "mla", "--draft-temperature", "1"], "mla drafter"),
        (["generate", "x", "--draft-confidence", "1"], "draft_confidence must be"),
        (["generate", "x", "--draft-confidence", "nan"], "draft_confidence must be"),
        (["generate", "x", "--max-draft-confidence", "1.5"], "max_draft_confidence must be"),
        (["eval", "--max-draft-confidence", "0.5,x"], "--max-draft-confidence"),
        (["bench", "--methods", "fly,vllm-fly"], "vllm-fly run in vLLM: add --engine vllm"),
        (["bench", "--engine", "vllm", "--concurrency", "0"], "--concurrency must be >= 1"),
        (["serve", "--dry-run"], "--dry-run prints the command of a vLLM server"),
        (["generate", "x", "--seed", str(2**64)], "seed must be an integer in [0, 2**63 - 1]"),
        (["generate", "x", "--seed", "-1"], "seed must be an integer in [0, 2**63 - 1]"),
        (["generate", "x", "--presence-penalty", "3"], "presence_penalty must be"),
        (["generate", "x", "--repetition-penalty", "0"], "repetition_penalty must be"),
        (
            ["serve", "--engine", "vllm", "--frequency-penalty", "1", "--dry-run"],
            "not mapped onto vLLM",
        ),
        (["generate", "\udcff"], "the prompt is not valid UTF-8: byte 0xff at offset 0"),
        (["bench", "--methods", "fly@0"], "must be an integer >= 1 or auto, in 'fly@0'"),
        (["bench", "--methods", "target@3"], "method target drafts nothing"),
        (["bench", "--methods", "llamacpp-lookahead"], "unknown method(s) llamacpp-lookahead"),
        (["bench", "--backend", "llamacpp"], "through its llamacpp-* methods"),
        (["serve", "--engine", "vllm", "-k", "auto", "--dry-run"], "-k auto runs in flyspec"),
        (["generate", "x", "--backend", "llamacpp", "--dtype", "bfloat16"], "drop --device"),
        (["generate", "x", "--threads", "-1"], "--threads must be >= 0"),
        (["generate", "x", "--backend", "llamacpp", "--threads", "-2"], "--threads must be >= 0"),
        (["bench", "--llamacpp-threads", "-1"], "--threads must be >= 0"),
        (
            ["generate", "x", "--dtype", "bfloat16", "--target-quant", "int8"],
            "choose one (--dtype float32, or --target-quant none)",
        ),
    ],
)
def test_bad_settings_give_one_line_errors(capsys, arguments, fragment):
    code, _, err = run_cli(capsys, *arguments)
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("command", [["serve"], ["bench"]])
def test_engine_vllm_without_vllm_says_how_to_install_it(capsys, monkeypatch, command):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.delenv("FLYSPEC_API_KEY", raising=False)  # refused with --engine vllm
    code, _, err = run_cli(capsys, *command, "--engine", "vllm")
    assert_one_line_error(code, err, "vLLM is not installed in this environment")
    assert "scripts/setup.sh --vllm" in err


def test_a_block_size_neither_integer_nor_auto_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x", "-k", "fast"])
    assert exit_info.value.code == 2
    assert "not an integer or auto: 'fast'" in capsys.readouterr().err


def test_unknown_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x", "--mode", "fast"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert_one_line_error(2, err, "invalid choice: 'fast'")


def test_missing_model_path(capsys, tiny_pair, tmp_path):
    draft, _ = tiny_pair
    code, _, err = run_cli(
        capsys, "generate", "x", "--target", str(tmp_path / "nope"), "--draft", str(draft)
    )
    assert_one_line_error(code, err, "does not exist")


def test_pair_with_different_vocabularies_is_refused(capsys, tiny_pair, other_vocab_model):
    _, target = tiny_pair
    code, _, err = run_cli(
        capsys, "generate", "x", "--target", str(target), "--draft", str(other_vocab_model)
    )
    assert_one_line_error(code, err, "tokenizer")


def generate_on_tiny_pair(capsys, tiny_pair, *extra):
    draft, target = tiny_pair
    return run_cli(
        capsys, "generate", "def f", "--model", str(target), "--draft-model", str(draft), *extra
    )


def test_generate_json_on_the_tiny_pair(capsys, tiny_pair):
    code, out, _ = generate_on_tiny_pair(capsys, tiny_pair, "--max-new-tokens", "12", "--json")
    assert code == 0
    result = json.loads(out)
    stats = result["stats"]
    for name in ("rounds", "drafted", "accepted", "loosely_accepted", "rejected", "emitted"):
        assert isinstance(stats[name], int)
    assert stats["emitted"] == len(result["token_ids"])
    assert isinstance(result["text"], str) and "tau" in stats and "seconds" in stats
    assert result["peak_rss_bytes"] > 0


def bench_one_prompt(capsys, tiny_pair, *extra):
    draft, target = tiny_pair
    pair = ("--model", str(target), "--draft-model", str(draft))
    return run_cli(capsys, "bench", "--prompt", "def f", *pair, "--max-tokens", "12", *extra)


def test_bench_one_prompt_json_times_the_method_beside_the_target_alone(capsys, tiny_pair):
    code, out, err = bench_one_prompt(capsys, tiny_pair, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["emitted"] == len(result["token_ids"]) and result["text"]
    assert result["baseline"]["stats"]["tau"] == 1.0
    assert result["speedup"] > 0
    assert len(result["baseline_runs"]) == len(result["runs"]) == 2  # two alternated pairs
    spread = result["speedup_spread"]
    assert spread["repeats"] == 2 and spread["low"] <= result["speedup"] <= spread["high"]
    assert isinstance(result["reliable"], bool) and "busy" in result["machine_load"]
    assert result["peak_rss_bytes"] > 0
    assert "timing the target alone (2/2) ..." in err and "running fly (2/2), shown ..." in err


def test_bench_one_prompt_streams_the_answer_then_the_speedup(capsys, tiny_pair):
    code, out, err = bench_one_prompt(
        capsys, tiny_pair, "--methods", "spd@4", "--repeats", "1", "--show"
    )
    assert code == 0, err
    assert out.endswith("\n") and "\033[" in out  # coloured by origin
    summary, speedup = err.splitlines()[-2:]
    assert summary.startswith("[spd@4] ") and "tokens in" in summary
    assert "speedup over the target alone" in speedup


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--methods", "fly,spd"], "--prompt times one method of flyspec's decoder"),
        (["--methods", "target"], "--prompt times one method of flyspec's decoder"),
        (["--methods", "hf-pld"], "--prompt times one method of flyspec's decoder"),
        (["--methods", "fly@0"], "block size after @"),
        (["--methods", "predict"], "predict drafts from a prediction: give --prediction"),
        (["--prediction", "p.txt"], "fly drafts from no prediction"),
        (["--limit", "3"], "--prompt times one prompt: drop --limit"),
        (["--forward-cost"], "--prompt times one prompt: drop --forward-cost"),
        (["--engine", "vllm"], "--prompt times one prompt: drop --engine vllm"),
        (["--repeats", "0"], "--repeats and --context-tokens must be >= 1"),
    ],
)
def test_bench_one_prompt_refuses_what_it_cannot_do_in_one_line(capsys, arguments, fragment):
    code, _, err = run_cli(capsys, "bench", "--prompt", "x", *arguments)
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("arguments", [["--show"], ["--prediction", "p.txt"]])
def test_the_one_prompt_options_need_a_prompt(capsys, arguments):
    code, _, err = run_cli(capsys, "bench", *arguments)
    assert_one_line_error(code, err, "is for --prompt")


@pytest.mark.parametrize(
    "arguments", [["--compare-target"], ["--compare-pairs", "3"], ["--json", "--compare-target"]]
)
def test_generate_points_the_comparison_to_bench_in_one_line(capsys, arguments):
    code, out, err = run_cli(capsys, "generate", "x", *arguments)
    assert_one_line_error(code, err, "`flyspec bench --prompt PROMPT`")
    assert out == "" and "loading" not in err


def test_generate_decodes_under_the_penalties_given(capsys, tiny_pair):
    plain = generate_on_tiny_pair(capsys, tiny_pair, "--max-tokens", "16", "--json")
    penalised = generate_on_tiny_pair(
        capsys,
        tiny_pair,
        "--max-tokens",
        "16",
        "--json",
        "--frequency-penalty",
        "2",
        "--presence-penalty",
        "1",
        "--repetition-penalty",
        "1.5",
    )
    assert plain[0] == penalised[0] == 0
    plain_ids, penalised_ids = (json.loads(out)["token_ids"] for _, out, _ in (plain, penalised))
    assert penalised_ids != plain_ids
    # No token of the answer repeats more than the plain answer's most repeated one.
    assert max(map(penalised_ids.count, penalised_ids)) <= max(map(plain_ids.count, plain_ids))


def comparison(target_speeds, method_speeds, others_cpu_fraction):
    from flyspec.bench.one_prompt import TargetComparison
    from flyspec.support.machine import CpuLoad

    def stats(tokens_per_second):  # the two members of RequestStats the comparison reads
        return SimpleNamespace(
            tokens_per_second=tokens_per_second, as_dict=lambda: {"tps": tokens_per_second}
        )

    compared = TargetComparison(pairs=len(target_speeds))
    compared.target = [SimpleNamespace(stats=stats(v), as_dict=dict) for v in target_speeds]
    compared.method = [stats(v) for v in method_speeds[:-1]]
    compared.monitor = SimpleNamespace(stop=lambda: CpuLoad(10.0, others_cpu_fraction, 0.0, 1.0))
    compared.finish(stats(method_speeds[-1]))
    return compared


def test_comparison_on_a_quiet_machine_states_the_median_and_range():
    compared = comparison([4.0, 4.1], [10.0, 10.4], 0.01)
    assert compared.reliable
    line = compared.line()
    assert line.startswith("speedup over the target alone: 2.52x (2.50-2.54x over 2 repeats")
    assert "NOT" not in line


def test_pairs_that_agree_on_direction_and_size_give_their_range_plainly():
    compared = comparison([4.0, 4.0], [13.44, 16.52], 0.01)  # 3.36x and 4.13x
    assert compared.reliable
    line = compared.line()
    assert line.startswith("speedup over the target alone: 3.36x to 4.13x over 2 alternated pairs")
    assert "NOT" not in line


def test_the_closing_lines_name_llamacpps_speeds_where_they_ran_the_server_first():
    from flyspec.bench.one_prompt import PlainPeer

    compared = comparison([4.0, 4.0], [10.0, 10.0], 0.01)
    compared.label = "fly"
    compared.peers = [
        PlainPeer("llama-server", "llama_server", None, "t.gguf", [25.0, 20.0]),
        PlainPeer("llama.cpp's Python binding", "llamacpp", None, "t.gguf", [20.0, 25.0, 22.0]),
    ]
    server, binding = compared.line().splitlines()[-2:]
    assert server.startswith("llama-server, plain decoding of the same target (t.gguf): 22.50")
    assert binding.startswith(
        "llama.cpp's Python binding, plain decoding of the same target (t.gguf): 22.00 tok/s"
    )
    assert binding.endswith("fly here runs at 0.45x its speed")


@pytest.mark.parametrize(
    ("targets", "methods", "others", "reason"),
    [
        ([4.0, 4.0], [3.6, 10.0], 0.01, "the 2 pairs disagree (0.90x to 2.50x)"),
        ([4.0, 4.0], [8.0, 20.0], 0.01, "the 2 pairs disagree (2.00x to 5.00x)"),
        ([4.0, 4.0], [8.8, 9.0], 0.5, "the machine was busy (other processes used 50% of"),
    ],
)
def test_comparison_that_cannot_be_trusted_says_why(targets, methods, others, reason):
    compared = comparison(targets, methods, others)
    line = compared.line()
    assert not compared.reliable
    assert "NOT measured reliably" in line and reason in line
    assert not line.startswith("speedup over the target alone: 0.")  # never a bare ratio


@pytest.mark.parametrize("extra", [[], ["--show"], ["--mode", "target"], ["--drafter", "mla"]])
def test_generate_streams_text_then_a_summary(capsys, tiny_pair, extra):
    code, out, err = generate_on_tiny_pair(capsys, tiny_pair, "--max-new-tokens", "8", *extra)
    assert code == 0
    assert out.endswith("\n")
    assert "tokens in" in err.splitlines()[-1]


@pytest.mark.parametrize(("extra", "calls"), [([], []), (["--threads", "1"], [1])])
def test_threads_set_torchs_threads_on_the_torch_backend(
    capsys, monkeypatch, tiny_pair, extra, calls
):
    import flyspec.support.cpu_math

    seen = []
    monkeypatch.setattr(flyspec.support.cpu_math, "set_torch_threads", seen.append)
    code, _, err = generate_on_tiny_pair(capsys, tiny_pair, "--max-tokens", "2", *extra)
    assert code == 0, err
    assert seen == calls


def test_generate_with_a_prediction_keeps_the_text_and_counts_it(capsys, tiny_pair, tmp_path):
    exact = ("--mode", "spd", "--drafter", "ngram", "--max-new-tokens", "16", "--json")
    plain = json.loads(generate_on_tiny_pair(capsys, tiny_pair, *exact)[1])
    prediction = tmp_path / "prediction.txt"
    prediction.write_text(plain["text"], encoding="utf-8")
    code, out, err = generate_on_tiny_pair(
        capsys, tiny_pair, *exact, "--prediction", str(prediction)
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] == plain["token_ids"]
    assert result["stats"]["accepted_prediction_tokens"] > 0
    code, _, err = generate_on_tiny_pair(
        capsys, tiny_pair, "--mode", "spd", "--max-new-tokens", "4", "--prediction", str(prediction)
    )
    assert code == 0 and "of its drafted tokens kept" in err


@pytest.mark.parametrize("bench", [False, True])
@pytest.mark.parametrize("extra", [["--json"], []])
def test_a_prediction_past_the_context_is_a_one_line_error(
    capsys, tiny_pair, tmp_path, extra, bench
):
    """Checked once, by the library, before any timed run."""
    prediction = tmp_path / "prediction.txt"
    prediction.write_text("x = 1\n" * 1024, encoding="utf-8")  # the tiny models hold 1024
    given = ("--prediction", str(prediction), *extra)
    if bench:
        code, _, err = bench_one_prompt(capsys, tiny_pair, "--methods", "predict", *given)
    else:
        code, _, err = generate_on_tiny_pair(capsys, tiny_pair, "--mode", "spd", *given)
    assert_one_line_error(code, err, "does not fit in the model's context")
    assert "timing" not in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "cannot read the prediction file"), (b"", "is empty"), (b"\xff", "not valid UTF-8")],
)
def test_bad_prediction_files_are_one_line_errors(capsys, tmp_path, content, fragment):
    path = tmp_path / "prediction.txt"
    if content is not None:
        path.write_bytes(content)
    code, _, err = run_cli(capsys, "generate", "x", "--prediction", str(path))
    assert_one_line_error(code, err, fragment)


def test_prompt_and_prediction_cannot_both_come_from_standard_input(capsys):
    code, _, err = run_cli(capsys, "generate", "-", "--prediction", "-")
    assert_one_line_error(code, err, "cannot both be read from standard input")


@pytest.mark.parametrize("data", [b"def \xff", b"def \xc3", b"\xed\xa0\x80"])
def test_invalid_utf8_on_standard_input_is_a_one_line_error(capsys, monkeypatch, data):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, _, err = run_cli(capsys, "generate", "-")
    assert_one_line_error(code, err, "standard input is not valid UTF-8: byte 0x")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_target_with_the_default_int8_draft(capsys, tiny_pair, dtype):
    code, out, err = generate_on_tiny_pair(
        capsys, tiny_pair, "--dtype", dtype, "--max-new-tokens", "6", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["stats"]["emitted"] == 6
    assert "draft: int8" in err and f"(dtype: {dtype}," in err


def test_the_dtype_is_float32_by_default_on_the_cpu_and_the_load_line_says_so(capsys, tiny_pair):
    code, out, err = generate_on_tiny_pair(capsys, tiny_pair, "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert "(dtype: float32 (auto)," in err


@pytest.mark.parametrize("temperature", ["1e-300", "1e-100", "1e-40", "1e-6"])
def test_temperatures_too_small_to_divide_by_decode_greedily(capsys, tiny_pair, temperature):
    greedy = json.loads(generate_on_tiny_pair(capsys, tiny_pair, "--json")[1])
    code, out, err = generate_on_tiny_pair(
        capsys, tiny_pair, "--temperature", temperature, "--seed", "1", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["token_ids"] == greedy["token_ids"]


def test_installed_entry_point_reports_errors_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "flyspec.cli", "generate", "x", "-k", "-3"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "flyspec: error: k must be an integer >= 1, got -3"


def test_generate_follows_a_json_schema(capsys, tiny_pair, tmp_path):
    """The tiny pair's tokenizer is JSON-capable (characters): the answer is held to the
    schema; an enum and a boolean end within the budget (bounded whitespace)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["x", "yy"]}},
        "required": ["ok", "kind"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for extra in (["--json-schema", str(path)], ["--json-object"]):
        code, out, _ = generate_on_tiny_pair(
            capsys, tiny_pair, "--max-tokens", "300", "--json", "--mode", "fly", *extra
        )
        assert code == 0
        result = json.loads(out)
        value = json.loads(result["text"])
        assert isinstance(value, dict)
        if extra[0] == "--json-schema":
            assert set(value) == {"ok", "kind"}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read the schema file"),
        (b"{nope", "is not JSON"),
        (b"[1]", "no JSON object"),
        (b'{"type": "frob"}', "frob"),
    ],
)
def test_bad_schema_files_are_one_line_errors(capsys, tiny_pair, tmp_path, content, fragment):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_bytes(content)
    code, _, err = generate_on_tiny_pair(capsys, tiny_pair, "--json-schema", str(path))
    assert_one_line_error(code, err, fragment)
