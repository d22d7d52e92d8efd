"""benchmarks/gpu_first_look.py: its CPU form runs every phase on tiny shapes, prints the table
it writes under $OUT and --output, and a failing phase is a row that does not stop the run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.models.cache import common_prefix_length
from flyspec.models.timing import DeviceSpan
from tests.tiny import make_tiny_model

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_first_look.py"
sys.path.insert(0, str(_PATH.parent))  # the script's package, first_look, beside it

from first_look.phases.compiled import same_as_eager  # noqa: E402
from first_look.phases.goals import GOALS  # noqa: E402
from first_look.phases.kernel_check import kernel_row  # noqa: E402
from first_look.phases.projection import break_even_text  # noqa: E402
from first_look.phases.replay import load_replay_traces  # noqa: E402
from first_look.phases.same_tokens import (  # noqa: E402
    NEAR_TIE,
    SameTokensCase,
    compiled_against_eager_row,
    same_tokens_row,
)
from first_look.plan import QUICK_ORDER, QUICK_REPLAYS, REPLAYS, TINY  # noqa: E402
from first_look.runner import PhaseRunner  # noqa: E402
from first_look.table import Row, markdown, write_outputs  # noqa: E402

TAU = json.loads((_PATH.parent / "gpu_configs" / "measured_tau.json").read_text())
TAU_ENTRIES = [(e["method"], e["k"], e["tau"]) for run in TAU["runs"] for e in run["tau"]]
OVERHEAD_KS = sorted({4, 8, 15} | {k for _, k, _ in TAU_ENTRIES})


@pytest.fixture(scope="module")
def cpu_form(tmp_path_factory):
    """One run of the CPU form: ``(stdout, report from $OUT, folder of --output)``."""
    folder = tmp_path_factory.mktemp("first-look")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env["OUT"] = str(folder / "out")
    completed = subprocess.run(
        [sys.executable, str(_PATH), "--device", "cpu", "--tiny", "--output", str(folder / "own")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((folder / "out" / "gpu_first_look.json").read_text())
    return completed.stdout, report, folder / "own"


def run_script(folder, *arguments, timeout):
    """The script's report of one run on the CPU with ``arguments``, written under
    ``folder``."""
    completed = subprocess.run(
        [sys.executable, str(_PATH), "--device", "cpu", *arguments, "--output", str(folder)],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "OUT"},
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((folder / "gpu_first_look.json").read_text())


def rows_of(report, phase):
    return [row for row in report["rows"] if row["phase"] == phase]


def test_the_attention_rows_name_the_kernel_and_time_each_one(cpu_form):
    _, report, _ = cpu_form
    rows = rows_of(report, "attention")
    assert [row["subject"] for row in rows] == [
        f"target {n}: SDPA at the compiled shapes" for n in ("1.5b", "7b", "32b")
    ]
    for row in rows:
        sizes = row["values"]["sizes"]
        assert list(sizes) == ["1", "16", "65"]
        for timings in sizes.values():
            assert timings["default_ms"] > 0 and timings["live_length_ms"] > 0
            assert timings["math_ms"] > 0  # the reference kernel takes every shape
            forced = [k for k in ("efficient", "flash", "cudnn") if timings[f"{k}_ms"] is None]
            assert all(timings[f"{k}_refused"] for k in forced)


def test_the_cpu_form_prints_one_table_and_writes_it_twice(cpu_form):
    stdout, report, own = cpu_form
    lines = stdout.strip().splitlines()
    assert lines[0] == "| phase | subject | result | detail |"
    assert all(line.startswith("| ") for line in lines[2:])
    assert len(lines) == 2 + len(report["rows"])
    assert "\n".join(lines) in (own / "gpu_first_look.md").read_text()
    assert json.loads((own / "gpu_first_look.json").read_text())["rows"] == report["rows"]
    assert report["environment"]["tiny"] is True
    assert report["environment"]["complete"] is True


def test_every_phase_has_its_rows_and_only_the_kernel_check_is_skipped(cpu_form):
    _, report, _ = cpu_form
    counts = {}
    for row in report["rows"]:
        counts[row["phase"]] = counts.get(row["phase"], 0) + 1
    assert counts == {
        "device": 1,
        "bandwidth": 1,
        # float32 draft and target for the same tokens; draft and targets eager, then compiled
        "model": 2 + 4 + 4,
        "same tokens": 1 + 8 + 1 + 2,
        "forward cost": 4,
        "engine alone": 4,
        "profile": 1,
        "loop overhead": 3 * len(OVERHEAD_KS),
        "projection": 3 * len(TAU_ENTRIES),
        "kernel check": 1,
        "attention": 3,  # a row per target
        "compiled": 3 * 2 + 1,  # each target alone and its V(n); the first drafting for itself
        "replay": sum(len(plan) for plan in REPLAYS.values()),
        # the models that compile: the same tokens' target and draft, and each target (all
        # float32 on the CPU, and of one tiny shape: the first compiles, the others reuse)
        "compiles": 4,
        "goal": len(GOALS) + 1,
    }
    (kernel,) = rows_of(report, "kernel check")
    assert kernel["status"] == "skipped"
    assert kernel["result"] in ("kernels not extracted", "on the CPU it needs TRITON_INTERPRET=1")
    others = [row for row in report["rows"] if row["phase"] != "kernel check"]
    assert [row for row in others if row["status"] != "ok"] == []


def test_costs_engine_and_loop_rows_hold_consistent_figures(cpu_form):
    _, report, _ = cpu_form
    targets = [row for row in rows_of(report, "forward cost") if "V(n)" in row["subject"]]
    assert [row["subject"] for row in targets] == [
        f"target {n}: V(n)" for n in ("1.5b", "7b", "32b")
    ]
    for row in targets:
        assert sorted(int(n) for n in row["values"]["median_ms"]) == list(range(1, 17))
        assert row["values"]["ratio"]["1"] == 1.0
    for row in rows_of(report, "engine alone"):
        values = row["values"]
        assert values["ms_per_token"] > 0 and values["bound_ms"] > 0
        assert values["loop_ms_per_token"] == pytest.approx(
            values["ms_per_token"] - values["forward_ms_per_token"]
        )
        assert values["syncs_per_token"] is None  # counted on CUDA only
    overheads = rows_of(report, "loop overhead")
    assert sorted({row["values"]["k"] for row in overheads}) == OVERHEAD_KS
    for row in overheads:
        values = row["values"]
        assert values["round_ms"] == pytest.approx(
            values["forward_ms_per_round"] + values["overhead_ms_per_round"]
        )
        assert 1 <= values["tokens_per_round"] <= values["k"] + 1
        assert values["rounds"] >= 1


def test_exact_decodes_give_the_target_alone_tokens_and_the_others_run(cpu_form):
    _, report, _ = cpu_form
    greedy, *cases, against_eager, compiled_spd, compiled_prediction = rows_of(
        report, "same tokens"
    )
    assert greedy["subject"] == "the target alone, greedy"
    lossless = [row for row in cases if row["subject"].startswith("spd")]
    assert len(lossless) == 4 and len(cases) == 8
    # float32 on the CPU: the compiled target gives the eager tokens, and its exact decodes
    # give the compiled target's.
    assert against_eager["result"] == "24/24 tokens as eager"
    assert set(against_eager["values"]["compile_checks"]) == {"token", "block"}
    for row in (compiled_spd, compiled_prediction):
        assert row["subject"].endswith(", compiled")
        assert row["result"] == "24/24 tokens as the target alone"
    for row in cases:
        values = row["values"]
        assert values["tokens"] == TINY.same_tokens
        if row in lossless:
            assert values["same_as_target"] == values["tokens"]
            assert row["result"] == "24/24 tokens as the target alone"
        else:
            assert row["result"].startswith("ran: 24 tokens")
    by_subject = {row["subject"]: row["values"] for row in cases}
    # The seeded draft differs from the target: its blocks are rejected, the rejection path
    # runs; the target drafting for itself and its own answer as the prediction keep all.
    assert by_subject["spd K=8, the draft model drafting"]["kept_exactly"] == 0
    for subject in ("the target drafting for itself", "the target's own answer as the prediction"):
        values = by_subject[f"spd K=8, {subject}"]
        assert values["kept_exactly"] == values["drafted"] > 0


def test_an_exact_decode_that_differs_fails_with_the_target_margin_there():
    target, other = make_tiny_model(vocab_size=64, seed=3), make_tiny_model(vocab_size=64, seed=4)
    case = SameTokensCase("spd", DecodeConfig(mode="spd", k=4), draft="self")
    prompt = [5, 6, 7, 8]
    wrong = [
        event.token
        for event in SpeculativeDecoder(other).stream(
            prompt, DecodeConfig(mode="target", max_new_tokens=8)
        )
    ]
    row = same_tokens_row(case, target, target, prompt, wrong)
    assert row.status == "failed"
    differs = row.values["same_as_target"]
    assert row.result == f"differs from the target alone at token {differs + 1} of 8"
    assert row.values["target_top2_margin"] > 0
    assert "top-2 logit margin there" in row.detail


def test_a_compiled_decode_that_leaves_eager_where_the_target_was_sure_fails():
    target, other = make_tiny_model(vocab_size=64, seed=3), make_tiny_model(vocab_size=64, seed=4)
    prompt = [5, 6, 7, 8]
    config = DecodeConfig(mode="target", max_new_tokens=8)
    wrong = [e.token for e in SpeculativeDecoder(other).stream(prompt, config)]
    compiled: list[int] = []
    row = compiled_against_eager_row(target, prompt, wrong, compiled)
    differs = row.values["same_as_eager"]
    assert compiled and compiled != wrong and row.values["token_ids"] == compiled
    assert row.values["eager_top2_margin"] >= NEAR_TIE
    assert (row.status, row.result) == ("failed", f"differs from eager at token {differs + 1} of 8")
    assert set(row.values["compile_checks"]) == {"token", "block"}


def test_a_device_span_on_the_cpu_is_the_clock_around_its_block():
    with DeviceSpan(torch.device("cpu")) as span:
        time.sleep(0.02)
    assert 0.02 <= span.seconds() < 1


def test_the_tokens_in_common_count_up_to_a_missing_or_extra_one():
    common = common_prefix_length  # what the rows count with
    assert common([1, 2, 3], [1, 2, 3]) == 3
    assert common([1, 9, 3], [1, 2, 3]) == 1
    assert common([1, 2], [1, 2, 3]) == 2
    assert common([1, 2, 3, 4], [1, 2, 3]) == 3


def test_the_compiled_rows_compare_with_the_eager_rows_of_the_run(cpu_form):
    _, report, _ = cpu_form
    compiled = {row["subject"]: row for row in rows_of(report, "compiled")}
    alone = compiled["target 1.5b, mode target, compiled"]
    drafting = compiled["target 1.5b drafting for itself, FLy K=8, compiled"]
    costs = compiled["target 1.5b: V(n), compiled"]["values"]
    assert [int(n) for n in costs["median_ms"]] == [1, 2, 4, 8, 16, 32, 65]
    eager_alone = next(r for r in rows_of(report, "engine alone") if "target 1.5b" in r["subject"])
    eager_drafting = next(
        r
        for r in rows_of(report, "loop overhead")
        if r["subject"].endswith("1.5b drafting for itself, FLy K=8")
    )
    assert alone["subject"].endswith(", compiled") and drafting["values"]["k"] == 8
    for row, eager, key in (
        (alone, eager_alone, "ms_per_token"),
        (drafting, eager_drafting, "round_ms"),
    ):
        assert row["values"][f"{key}_compiled_over_eager"] == pytest.approx(
            row["values"][key] / eager["values"][key]
        )
        assert row["values"]["seconds_with_compiling"] > 0
        assert row["values"]["graphs_compiled"] >= 0
        # float32 on the CPU: compiled and eager decodes give the same tokens.
        ids = eager["values"]["token_ids"]
        assert row["values"]["token_ids"] == ids and row["values"]["same_as_eager"] == len(ids)
        assert f"the same {len(ids)} tokens as eager" in row["detail"]


def test_each_trace_is_replayed_at_its_recorded_acceptance(cpu_form):
    _, report, _ = cpu_form
    replays = rows_of(report, "replay")
    traces = load_replay_traces()
    plan = [pair for name in ("1.5b", "7b", "32b") for pair in REPLAYS[name]]
    names = [name for name in ("1.5b", "7b", "32b") for _ in REPLAYS[name]]
    expected = [
        f"{trace} ({subset}) on the {name} target, compiled"
        for name, (subset, trace) in zip(names, plan, strict=True)
    ]
    assert [row["subject"] for row in replays] == expected
    for row, (subset, trace) in zip(replays, plan, strict=True):
        values = row["values"]
        assert values["trace_tau"] == pytest.approx(traces[subset, trace].tau)
        assert values["speedup"] == pytest.approx(
            values["tokens_per_second"] / values["alone_tokens_per_second"]
        )
        assert "measured at the real pair's recorded acceptance" in row["result"]
        assert values["overruled"] == 0  # float32: the target agrees with what it replays


def test_the_quick_form_runs_the_goal_rows_only(tmp_path):
    report = run_script(tmp_path, "--tiny", "--quick", timeout=300)
    phases = [row["phase"] for row in report["rows"]]
    assert set(phases) == {
        "device",
        "bandwidth",
        "model",
        "same tokens",
        "attention",
        "compiled",
        "replay",
        "compiles",
        "goal",
    }
    # the targets' goals first, the same tokens after them, the tables of compiles and goals last
    assert phases.index("compiled") < phases.index("same tokens") < phases.index("compiles")
    assert phases[-len(GOALS) - 1 :] == ["goal"] * (len(GOALS) + 1)
    replays = [row["subject"] for row in rows_of(report, "replay")]
    assert replays == [
        f"{trace} ({subset}) on the {name} target, compiled"
        for name in QUICK_ORDER
        for subset, trace in QUICK_REPLAYS.get(name, ())
    ]
    compiled = [row["subject"] for row in rows_of(report, "compiled")]
    assert compiled[0] == "target 32b, mode target, compiled"  # the largest first
    assert all(row["status"] == "ok" for row in report["rows"])


def test_a_compiled_decode_that_differs_is_told_not_failed():
    values = {"token_ids": [1, 2, 7, 4]}
    text = same_as_eager(values, [1, 2, 3, 4])
    assert text == "the eager decode's tokens up to token 3 of 4"
    assert values["same_as_eager"] == 2


def test_projections_follow_break_even_from_the_measured_costs_and_tau(cpu_form):
    _, report, _ = cpu_form
    (draft,) = [
        row for row in rows_of(report, "forward cost") if row["subject"].startswith("draft")
    ]
    d = draft["values"]["median_ms"]["1"]
    costs = {
        row["subject"].split()[1].rstrip(":"): row["values"]["median_ms"]
        for row in rows_of(report, "forward cost")
        if row["subject"].startswith("target")
    }
    projections = rows_of(report, "projection")
    for row in projections:
        values = row["values"]
        target = row["subject"].split(" on the ")[1].split()[0]
        v = costs[target]
        k, tau = values["k"], values["tau"]
        assert (row["subject"].split()[0], k, tau) in TAU_ENTRIES
        assert values["source"]["commit"] in row["subject"]
        assert set(values["source"]) >= {"date", "commit", "machine", "command"}
        assert values["draft_to_target"] == pytest.approx(d / v["1"])
        assert values["measured_ratio"] == pytest.approx(v[str(k + 1)] / v["1"])
        assert values["break_even_ratio"] == pytest.approx(tau - k * d / v["1"])
        assert values["speedup_forwards_only"] == pytest.approx(
            tau * v["1"] / (k * d + v[str(k + 1)])
        )
        assert values["speedup_with_loop"] > 0
        assert row["detail"].startswith("PROJECTED, not measured")


def test_a_projection_out_of_reach_says_so_rather_than_a_bound_under_one():
    assert break_even_text(8, 6.96, 0.5) == "breaks even at V(9)/V(1) <= 2.96"
    text = break_even_text(8, 6.96, 0.8)  # needs 0.56: under one V(1)
    assert text == (
        "cannot break even: its 8 drafts cost 6.40 V(1) and the verify at least V(1), "
        "for 6.96 tokens"
    )


def test_a_failed_phase_is_a_row_with_its_reason_and_the_next_phase_runs():
    table = PhaseRunner(time_limit=600)

    def out_of_memory():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    table.phase("model", "32b", out_of_memory)
    table.phase("bandwidth", "copy", lambda: Row("bandwidth", "copy", "ok", "1 GB/s"))
    failed, ran = table.rows
    assert (failed.status, failed.result) == (
        "failed",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    )
    assert ran.status == "ok"
    assert "| model | 32b | FAILED: RuntimeError: CUDA out of memory" in markdown(table.rows)


def test_phases_past_the_time_limit_are_skipped():
    table = PhaseRunner(time_limit=-1)
    table.phase("model", "7b", lambda: pytest.fail("a phase past the time limit ran"))
    (row,) = table.rows
    assert (row.status, row.result) == ("skipped", "time limit of -1 s")


def test_a_phase_that_would_end_past_the_time_limit_is_skipped_and_rows_are_saved_as_made():
    saved = []
    table = PhaseRunner(time_limit=60, after_phase=lambda rows: saved.append(len(rows)))
    ok = Row("bandwidth", "copy", "ok", "1 GB/s")
    table.phase("bandwidth", "copy", lambda: ok, needs=30)
    table.phase("compiled", "1.5b", lambda: pytest.fail("it would end too late"), needs=90)
    assert [row.status for row in table.rows] == ["ok", "skipped"]
    assert table.rows[1].result.startswith("time limit of 60 s (needs about 90 s, ")
    assert saved == [1, 2]


def test_a_run_cut_short_leaves_its_rows_marked_partial(tmp_path):
    env = {"device_description": "a GPU", "elapsed_s": 12.0, "complete": False}
    env |= {k: "x" for k in ("dtype", "torch", "transformers", "python", "commit", "date")}
    env["tiny"] = False
    rows = [Row("bandwidth", "copy", "ok", "1 GB/s")]
    write_outputs(tmp_path, env, rows)
    assert "PARTIAL" in (tmp_path / "gpu_first_look.md").read_text()
    write_outputs(tmp_path, {**env, "complete": True}, rows)
    assert "PARTIAL" not in (tmp_path / "gpu_first_look.md").read_text()


def test_the_kernel_check_says_why_it_did_not_run(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    missing = kernel_row(cpu, TINY, None, kernels=tmp_path)
    assert (missing.status, missing.result) == ("skipped", "kernels not extracted")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    interpreted = kernel_row(cpu, TINY, None, kernels=tmp_path)
    assert (interpreted.status, interpreted.result) == (
        "skipped",
        "on the CPU it needs TRITON_INTERPRET=1",
    )


def test_the_rehearsal_builds_and_compiles_every_model_of_the_lease(tmp_path):
    """``--rehearse --quick`` on the CPU: the lease's sequence, models of the real depths, heads
    and vocabularies, each of a shape of its own, in the lease's dtypes: every model compiles
    its own graphs in one process (the fifth used to fail at dynamo's recompile limit), no
    row fails, and the table of goals closes the run."""
    report = run_script(tmp_path, "--rehearse", "--quick", timeout=2400)
    assert report["environment"]["shapes"] == "rehearsal"
    assert [row for row in report["rows"] if row["status"] != "ok"] == []
    built = {row["subject"]: row["detail"] for row in rows_of(report, "model")}
    for name, layers, vocab in (("32b", 64, 152064), ("7b", 28, 152064), ("1.5b", 28, 151936)):
        details = [d for s, d in built.items() if s.startswith(f"{name} ")]
        assert details and all(
            d.startswith(f"{layers} layers, ") and f"vocab {vocab};" in d for d in details
        )
    compiles = {row["subject"]: row["values"] for row in rows_of(report, "compiles")}
    assert set(compiles) == {
        "32b bfloat16",
        "0.5b bfloat16",
        "7b bfloat16",
        "1.5b bfloat16",
        "1.5b float32",
        "0.5b float32",
    }
    for values in compiles.values():
        assert values["graphs"] == 2 and not values["failures"]  # one token, and blocks
        assert len(values["compile_s"]) == 2 and min(values["compile_s"]) > 0
    goals = rows_of(report, "goal")
    assert len(goals) == len(GOALS) + 1
    assert all(
        row["result"].split(":")[0].split(" ")[0] in ("MET", "MISSED", "NOT") for row in goals
    )
    assert goals[-1]["result"].startswith("MET: 7/7")  # exact decodes: the target's tokens
