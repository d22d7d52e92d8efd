"""``flyspec bench`` on a tiny random pair, and its arithmetic on hand-made numbers."""

import json
import math

import pytest

from flyspec.bench import run_benchmark
from flyspec.bench.forward_cost import format_forward_cost, measure_forward_cost, time_forwards
from flyspec.bench.methods import DEFAULT_METHODS, IN_PROCESS_METHODS, parse_methods
from flyspec.bench.prompts import BenchPrompt, build_prompt, encode_prompt, read_prompts_file
from flyspec.bench.report import (
    first_divergence,
    markdown_report,
    markdown_table,
    per_position_acceptance,
    tokens_per_round_histogram,
)
from flyspec.cli import main
from flyspec.config import DecodeConfig
from flyspec.decoding.stats import RoundStats, mean_speedup
from flyspec.errors import FlyspecError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def round_stats(drafted, accepted, loosely=0, emitted=None):
    if emitted is None:
        emitted = accepted + loosely + 1
    return RoundStats(drafted, accepted, loosely, emitted, 0.0, 0.0)


# --------------------------------------------------------------------------- arithmetic


def test_speedup_is_the_ratio_of_mean_per_sample_speeds():
    # Means 6 and 3 tok/s: 2x, not the ratio of pooled speeds nor the mean of ratios.
    assert mean_speedup([4.0, 8.0], [2.0, 4.0]) == pytest.approx(2.0)
    assert mean_speedup([3.0, 9.0], [4.0, 2.0]) == pytest.approx(6.0 / 3.0)
    assert mean_speedup([1.0], [3.0]) == pytest.approx(1 / 3)


def test_speedup_without_a_baseline_is_nan():
    assert math.isnan(mean_speedup([1.0], []))
    assert math.isnan(mean_speedup([1.0], [0.0]))


def test_per_position_acceptance_counts_kept_over_drafted():
    rounds = [
        round_stats(4, 4),  # all kept
        round_stats(4, 1),  # kept 0, rejected 1..3
        round_stats(4, 1, loosely=1),  # kept 0 (exact) and 1 (loose), rejected 2..3
        round_stats(2, 0),  # a short block: rejected at 0
    ]
    rates = per_position_acceptance(rounds, k=5)
    assert rates == [pytest.approx(3 / 4), pytest.approx(2 / 4), 1 / 3, 1 / 3, None]


def test_per_position_acceptance_of_an_empty_draft_is_undefined():
    assert per_position_acceptance([round_stats(0, 0)], k=2) == [None, None]


def test_tokens_per_round_histogram():
    rounds = [round_stats(3, 3), round_stats(3, 0), round_stats(3, 1), round_stats(3, 1, emitted=0)]
    assert tokens_per_round_histogram(rounds, k=3) == [1, 1, 1, 0, 1]


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_parse_methods_validates_and_adds_the_baseline():
    assert parse_methods("fly, spd") == ["target", "fly", "spd"]
    assert parse_methods(",".join(DEFAULT_METHODS)) == list(DEFAULT_METHODS)
    with pytest.raises(FlyspecError, match="unknown method.*eagle"):
        parse_methods("fly,eagle")
    with pytest.raises(FlyspecError, match="twice"):
        parse_methods("fly,fly")
    with pytest.raises(FlyspecError, match="empty"):
        parse_methods(" , ")


def test_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f"}\n\n{"id": "b", "prompt": "x", "chat": false}\n')
    prompts = read_prompts_file(path, limit=None, chat=True)
    assert prompts == [
        BenchPrompt("p/0", messages=({"role": "user", "content": "def f"},)),
        BenchPrompt("b", raw="x"),
    ]
    assert len(read_prompts_file(path, limit=1, chat=True)) == 1
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(FlyspecError, match="non-empty"):
        read_prompts_file(path, limit=None, chat=True)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_engine(tiny_pair):
    from flyspec.engine import Engine

    draft, target = tiny_pair
    return Engine.load(target=str(target), draft=str(draft))


PROMPTS = [
    BenchPrompt.from_text("a", "def fibonacci(n):\n    if n < 2:\n        return n\n", chat=False),
    BenchPrompt.from_text("b", "for i in range(10): print(i)", chat=True),
]


def test_run_benchmark_all_methods(tiny_engine):
    config = DecodeConfig(k=4, max_new_tokens=12)
    report = run_benchmark(tiny_engine, PROMPTS, IN_PROCESS_METHODS, config, progress=False)
    summaries = {s["method"]: s for s in report["methods"]}
    assert list(summaries) == list(IN_PROCESS_METHODS)
    for name, summary in summaries.items():
        assert summary["samples"] == 2
        assert summary["tokens_per_second"] > 0, name
        assert summary["speedup"] > 0, name
        assert len(report["samples"][name]) == 2
    assert summaries["target"]["speedup"] == pytest.approx(1.0)
    # Lossless methods reproduce the target token for token.
    for name in ("spd", "ngram"):
        assert summaries[name]["identical_to_target"] == 2, name
    fly = summaries["fly"]
    assert len(fly["per_position_acceptance"]) == 4
    assert sum(fly["tokens_per_round_histogram"]) == fly["rounds"]
    assert fly["drafted"] == fly["accepted"] + fly["loosely_accepted"] + sum(
        s["stats"]["rejected"] for s in report["samples"]["fly"]
    )
    assert "tau" not in summaries["hf-assisted-k"]
    assert summaries["hf-assisted-k"]["settings"]["num_assistant_tokens"] == 4
    assert summaries["hf-assisted-k"]["settings"]["assistant_confidence_threshold"] == 0
    # The draft's own generation config is left as it was.
    assert tiny_engine.draft_model.generation_config.num_assistant_tokens is None


def test_fly_paper_runs_the_papers_default_beside_other_settings(tiny_engine):
    from flyspec.config import FlyConfig

    beyond = FlyConfig(theta=0.0, window=1, min_ratio=0.5, max_rank=2, defer=True)
    config = DecodeConfig(k=4, max_new_tokens=12, fly=beyond)
    methods = ["target", "fly", "fly-paper"]
    report = run_benchmark(tiny_engine, PROMPTS, methods, config, progress=False)
    settings = {s["method"]: s["settings"] for s in report["methods"]}
    assert settings["fly"]["min_ratio"] == 0.5 and settings["fly"]["defer"] is True
    assert settings["fly"]["theta"] == 0.0 and settings["fly"]["window"] == 1
    paper = {key: settings["fly-paper"][key] for key in ("theta", "window", "min_ratio", "defer")}
    assert paper == {"theta": 0.3, "window": 6, "min_ratio": 0.0, "defer": False}
    for records in report["samples"].values():
        for record in records:
            assert record["new_tokens"] <= 12
    json.dumps(report)  # serialisable
    assert "| fly |" in markdown_table(report["methods"])


def test_bench_command_end_to_end(tiny_pair, tmp_path, capsys):
    draft, target = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"id": p.id, "prompt": p.raw or p.messages[0]["content"], "chat": p.chat})
            for p in PROMPTS
        )
    )
    output = tmp_path / "out"
    code = main(
        [
            "bench",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--prompts-file",
            str(prompts),
            "-k",
            "3",
            "--max-new-tokens",
            "8",
            "--output",
            str(output),
            "--json",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    written = json.loads((output / "bench.json").read_text())
    assert written["config"]["k"] == report["config"]["k"] == 3
    assert [s["method"] for s in written["methods"]] == list(DEFAULT_METHODS)
    assert {"python", "torch", "transformers", "cpu_model", "torch_threads", "date"} <= set(
        written["environment"]
    )
    assert written["config"]["kernels"]["linear"] == "onednn"
    assert written["config"]["kernels"]["draft_quant"] == "int8"
    summaries = {s["method"]: s for s in written["methods"]}
    for name in ("spd", "ngram"):  # still lossless on packed / quantised models
        assert summaries[name]["identical_to_target"] == 2, name
    table = (output / "bench.md").read_text()
    for name in DEFAULT_METHODS:
        assert f"| {name} |" in table
    for plot in ("speedup.png", "tokens-per-round.png", "acceptance-by-position.png"):
        assert (output / plot).read_bytes().startswith(PNG_MAGIC), plot


def test_repeats_keep_every_sample_and_report_medians_with_ranges(tiny_engine):
    config = DecodeConfig(k=3, max_new_tokens=6)
    methods = ["target", "spd", "fly"]
    report = run_benchmark(tiny_engine, PROMPTS, methods, config, progress=False, repeats=3)
    assert report["config"]["repeats"] == 3
    assert report["config"]["method_order_per_repeat"] == [
        ["target", "spd", "fly"],
        ["spd", "fly", "target"],
        ["fly", "target", "spd"],
    ]
    for name in methods:
        records = report["samples"][name]
        assert len(records) == 3 * len(PROMPTS)
        assert sorted({r["repeat"] for r in records}) == [0, 1, 2]
        summary = next(s for s in report["methods"] if s["method"] == name)
        assert summary["repeats"] == 3 and summary["samples"] == 6
        speed, speedup = summary["tokens_per_second_spread"], summary["speedup_spread"]
        assert speed["repeats"] == speedup["repeats"] == 3
        assert speed["low"] <= summary["tokens_per_second"] == speed["median"] <= speed["high"]
        assert speedup["low"] <= summary["speedup"] <= speedup["high"]
        assert isinstance(summary["unstable_prompts"], list)
    target = next(s for s in report["methods"] if s["method"] == "target")
    assert target["speedup_spread"]["low"] == target["speedup_spread"]["high"] == 1.0
    assert next(s for s in report["methods"] if s["method"] == "spd")["identical_to_target"] == 6
    load = report["machine_load"]
    assert set(load) >= {"others_cpu_fraction", "load_average", "busy", "busy_threshold"}
    assert len(report["machine_load_per_repeat"]) == 3
    assert report["environment"]["machine"]["vector_extensions"] is not None
    text = markdown_report({**report, "config": {**report["config"], "chat": False}})
    assert "medians over 3 repeats" in text and "Machine load during the run" in text
    assert " (" in markdown_table(report["methods"])  # ranges next to the medians


def test_unstable_prompts_are_flagged():
    from flyspec.bench.report import unstable_prompts

    samples = [{"prompt_id": "a", "tokens_per_second": v} for v in (10.0, 10.2, 9.9)] + [
        {"prompt_id": "b", "tokens_per_second": v} for v in (10.0, 5.1, 9.8)
    ]
    flagged = unstable_prompts(samples)
    assert [f["prompt_id"] for f in flagged] == ["b"]
    assert flagged[0]["tokens_per_second"]["low"] == 5.1


def test_bench_repeats_and_compare_on_the_command_line(tiny_pair, tmp_path, capsys):
    draft, target = tiny_pair
    common = ["bench", "--target", str(target), "--draft", str(draft), "--dataset", "humaneval"]
    common += ["--limit", "2", "-k", "3", "--max-new-tokens", "6", "--no-progress"]
    common += ["--methods", "target,fly"]
    assert main([*common, "--output", str(tmp_path / "old")]) == 0
    capsys.readouterr()
    code = main(
        [
            *common,
            "--repeats",
            "2",
            "--output",
            str(tmp_path / "new"),
            "--compare",
            str(tmp_path / "old"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Compared with" in captured.out and "| fly |" in captured.out
    assert "new/old" in captured.out
    # The same code and models generate the same tokens and statistics: both prompts of the
    # first repeat.
    comparison = captured.out[captured.out.index("Compared with") :]
    fly_row = next(line for line in comparison.splitlines() if line.startswith("| fly |"))
    assert fly_row.endswith("| 2/2 | 2/2 |")
    assert "flyspec: machine:" in captured.err and "during the run other processes" in captured.err
    new = json.loads((tmp_path / "new" / "bench.json").read_text())
    assert len(new["samples"]["fly"]) == 4


def test_compare_reads_old_reports_and_refuses_bad_files(tmp_path, capsys):
    from flyspec.bench.compare import (
        compare_reports,
        format_comparison,
        same_statistics,
        same_tokens,
    )

    old = {"methods": [{"method": "fly", "tokens_per_second": 10.0, "speedup": 2.0}]}
    new = {
        "methods": [
            {
                "method": "fly",
                "tokens_per_second": 14.0,
                "tokens_per_second_spread": {
                    "median": 14.0,
                    "low": 13.8,
                    "high": 14.1,
                    "repeats": 3,
                },
                "speedup": 2.05,
                "speedup_spread": {"median": 2.05, "low": 2.0, "high": 2.1, "repeats": 3},
            },
            {"method": "spd", "tokens_per_second": 9.0, "speedup": 1.8},
        ]
    }
    [(method, speed, speedup)] = compare_reports(old, new)
    assert method == "fly" and speed.ratio == pytest.approx(1.4) and speed.verdict == "faster"
    assert speedup.verdict == "~"
    for name, report in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(report))
    assert main(["compare", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert "| fly | 10.00 | 14.00 (13.80-14.10 over 3 repeats) | 1.400 | faster |" in (
        capsys.readouterr().out
    )
    vllm_run = {**old, "config": {"baseline": "vllm-target"}}
    text = format_comparison(vllm_run, new)
    assert "different baselines (vllm-target in the old run, target in the new one)" in text
    fly_row = next(line for line in text.splitlines() if line.startswith("| fly |"))
    assert fly_row.endswith("| n/a | n/a | n/a |")  # speedups, tokens, statistics
    assert same_tokens(old, new, "fly") is None
    assert same_statistics(old, new, "fly") is None
    with_tokens = {
        "samples": {
            "fly": [
                {"prompt_id": "a", "repeat": 0, "token_ids": [1, 2]},
                {"prompt_id": "b", "repeat": 0, "token_ids": [3]},
            ]
        }
    }
    changed = {"samples": {"fly": [{"prompt_id": "a", "repeat": 0, "token_ids": [1, 5]}]}}
    assert same_tokens(with_tokens, with_tokens, "fly") == (2, 2)
    assert same_tokens(with_tokens, changed, "fly") == (0, 1)
    stats = {"rounds": 3, "accepted": 4, "tau": 2.5, "deferrals_confirmed": 1, "seconds": 0.4}
    with_stats = {"samples": {"fly": [{"prompt_id": "a", "stats": stats}]}}
    slower = {"samples": {"fly": [{"prompt_id": "a", "stats": {**stats, "seconds": 0.9}}]}}
    fewer = {"samples": {"fly": [{"prompt_id": "a", "stats": {**stats, "accepted": 3}}]}}
    assert same_statistics(with_stats, slower, "fly") == (1, 1)  # times are not statistics
    assert same_statistics(with_stats, fewer, "fly") == (0, 1)
    assert same_statistics(with_tokens, with_stats, "fly") is None
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["compare", str(bad), str(tmp_path / "new")]) == 2
    for path in (bad, tmp_path / "missing.json"):
        code = main(["bench", "--compare", str(path), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and "--compare:" in err and "Traceback" not in err


def test_bench_rejects_unknown_methods(tiny_pair, capsys):
    code = main(["bench", "--methods", "fly,medusa", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown method(s) medusa" in err and "Traceback" not in err


def test_forward_cost_on_a_tiny_model(tiny_engine):
    costs = measure_forward_cost(
        tiny_engine.target_model, max_new_tokens=3, context_tokens=8, repeats=2, warmup=1
    )
    assert [c.new_tokens for c in costs] == [1, 2, 3]
    assert costs[0].ratio == 1.0
    assert all(c.median_ms > 0 for c in costs)
    table = format_forward_cost({"target": costs})
    assert table.count("\n") == 4


def test_time_forwards_times_every_path_and_size(tiny_engine):
    times = time_forwards(
        tiny_engine.target_model,
        new_tokens=[1, 4],
        forward_paths=("lean", "transformers"),
        context_tokens=8,
        repeats=3,
        warmup=1,
    )
    assert set(times) == {"lean", "transformers"}
    for per_size in times.values():
        assert set(per_size) == {1, 4}
        assert all(len(samples) == 3 and min(samples) > 0 for samples in per_size.values())
    with pytest.raises(ValueError):
        time_forwards(tiny_engine.target_model, new_tokens=[0])


def test_forward_cost_command(tiny_pair, tmp_path, capsys):
    draft, target = tiny_pair
    code = main(
        [
            "bench",
            "--forward-cost",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "-k",
            "2",
            "--context-tokens",
            "5",
            "--repeats",
            "1",
            "--output",
            str(tmp_path),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    written = json.loads((tmp_path / "forward-cost.json").read_text())
    assert [row["new_tokens"] for row in written["forward_cost"]["target"]] == [1, 2, 3]
    assert "| 3 |" in captured.out


def test_packed_linear_layers_keep_the_logits():
    import torch

    from flyspec.models.kernels import onednn_linear_available, pack_linear_layers
    from tests.tiny import make_tiny_model

    if not onednn_linear_available():
        pytest.skip("torch has no oneDNN linear ops here")
    model = make_tiny_model(vocab_size=96, seed=4)
    tokens = torch.tensor([[5, 9, 14, 3, 40, 41, 7]])
    with torch.inference_mode():
        expected = model(input_ids=tokens).logits
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert pack_linear_layers(model) == linears
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert torch.allclose(model(input_ids=tokens).logits, expected, atol=1e-4)
        assert pack_linear_layers(model) == 0  # nothing left to pack


def test_kernel_config_rejects_unknown_choices():
    from flyspec.config import KernelConfig

    with pytest.raises(FlyspecError, match="draft_quant must be one of none, int8, fp16"):
        KernelConfig(draft_quant="int4")
    with pytest.raises(FlyspecError, match="forward must be one of"):
        KernelConfig(forward="fast")


def test_engine_load_applies_the_commands_kernels_by_default(tiny_pair):
    import torch

    from flyspec.config import KernelConfig
    from flyspec.engine import Engine

    draft, target = tiny_pair
    default = Engine.load(target=str(target), draft=str(draft))
    assert default.kernels["draft_quant"] == KernelConfig().draft_quant == "int8"
    assert default.kernels["linear"] == "onednn" and default.kernels["forward"] == "lean"
    assert not any(type(m) is torch.nn.Linear for m in default.draft_model.modules())
    plain = Engine.load(target=str(target), draft=str(draft), kernels=KernelConfig.plain())
    assert plain.kernels["draft_quant"] == "none" and plain.kernels["forward"] == "transformers"
    assert all(
        type(m) is torch.nn.Linear
        for m in plain.target_model.modules()
        if isinstance(m, torch.nn.Linear)
    )


def test_dataset_prompts_follow_the_eval_tasks():
    from flyspec.evaluation.tasks import make_task
    from flyspec.support.datasets import HumanEvalProblem, MtBenchQuestion

    problem = HumanEvalProblem("HumanEval/0", "def f(x):\n", "f", "", "")
    prompt = build_prompt(problem, chat=True)
    expected = make_task("humaneval").prompt(problem, chat=True)
    assert prompt.messages == tuple(expected.messages)
    assert prompt.reply_prefix == expected.reply_prefix
    assert prompt.id == "HumanEval/0"
    assert build_prompt(problem, chat=False).raw == "def f(x):\n"
    question = MtBenchQuestion(81, "writing", ("Write a haiku.", "Now in French."))
    assert build_prompt(question, chat=True).messages[0]["content"] == "Write a haiku."


def test_encode_prompt_opens_the_reply(tiny_engine):
    prompt = BenchPrompt("x", messages=({"role": "user", "content": "hi"},), reply_prefix="def")
    ids = encode_prompt(tiny_engine.tokenizer, prompt)
    text = tiny_engine.tokenizer.decode(ids)
    assert text.replace("\n", "").endswith("<|im_start|>assistantdef")
    raw = BenchPrompt("y", raw="for")
    assert encode_prompt(tiny_engine.tokenizer, raw) == tiny_engine.encode("for")


def test_a_method_that_fails_is_reported_and_the_others_keep_their_figures(
    tiny_engine, monkeypatch
):
    from flyspec.bench.methods import FlyspecMethod
    from flyspec.bench.report import markdown_report

    run = FlyspecMethod.run

    def failing_on_b(self, prompt_ids, **settings):
        if self.name == "spd" and len(prompt_ids) == len(tiny_engine.encode("x = 1")):
            raise RuntimeError("the engine gave up\nat line two")
        return run(self, prompt_ids, **settings)

    monkeypatch.setattr(FlyspecMethod, "run", failing_on_b)
    prompts = [BenchPrompt(id="a", raw="def fibonacci(n):"), BenchPrompt(id="b", raw="x = 1")]
    config = DecodeConfig(k=3, max_new_tokens=6)
    report = run_benchmark(
        tiny_engine, prompts, ["target", "spd", "fly"], config, progress=False, warmup=False
    )
    assert [s["method"] for s in report["methods"]] == ["target", "fly"]
    assert all(s["samples"] == 2 for s in report["methods"])
    assert report["failed_methods"] == [
        {
            "method": "spd",
            "reason": "failed during prompt b: RuntimeError: the engine gave up at line two",
        }
    ]
    report["config"]["chat"] = False  # the command adds it
    text = markdown_report(report)
    assert "| fly |" in text and "- spd: failed during prompt b" in text
    assert all(s["touched_bytes"] > 0 for s in report["methods"])

    monkeypatch.setattr(FlyspecMethod, "run", lambda self, *a, **k: 1 / 0)
    with pytest.raises(FlyspecError, match="the baseline target failed during prompt a"):
        run_benchmark(tiny_engine, prompts, ["target", "fly"], config, progress=False, warmup=False)


def test_prediction_methods_draft_from_each_prompts_prediction(tiny_engine):
    """``predict`` drafts from the prompt's prediction and stays the target's text; a
    prediction that is the target's own answer is kept nearly whole; the decoding-alone speed
    is recorded next to the end-to-end one."""
    config = DecodeConfig(k=4, max_new_tokens=12)
    first = run_benchmark(tiny_engine, PROMPTS, ["target"], config, progress=False)
    answers = [record["text"] for record in first["samples"]["target"]]
    predicted = [
        BenchPrompt(id=p.id, messages=p.messages, raw=p.raw, prediction=answer)
        for p, answer in zip(PROMPTS, answers, strict=True)
    ]
    methods = ["target", "predict", "fly-predict"]
    report = run_benchmark(tiny_engine, predicted, methods, config, progress=False)
    summaries = {s["method"]: s for s in report["methods"]}
    assert summaries["predict"]["identical_to_target"] == len(PROMPTS)
    assert summaries["predict"]["settings"]["prediction"] is True
    for record in report["samples"]["predict"]:
        assert record["stats"]["accepted_prediction_tokens"] > 0
        assert record["decode_tokens_per_second"] >= record["tokens_per_second"]
