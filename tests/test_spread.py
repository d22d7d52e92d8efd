"""Repeated measurements (median, range, per-repeat ratios, run comparison) and the busy
detector."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flyspec.support.machine import (
    BUSY_CPU_FRACTION,
    TREE_COMMIT_FILE,
    CpuLoad,
    CpuMonitor,
    combined_load,
    describe_machine,
    git_commit,
    machine_identity,
)
from flyspec.support.repeated_measurements import (
    NOISE_FLOOR,
    UNSTABLE_SPREAD,
    Spread,
    compare,
    ratio_spread,
)


def test_spread_is_median_and_range():
    spread = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (spread.median, spread.low, spread.high, spread.count) == (2.5, 1.0, 10.0, 4)
    assert spread.relative == pytest.approx(9.0 / 2.5)
    assert spread.unstable


def test_spread_leaves_out_missing_values_and_survives_none_left():
    assert Spread.of([2.0, math.nan, None, 4.0]).median == 3.0
    empty = Spread.of([math.nan])
    assert empty.count == 0 and math.isnan(empty.median) and not empty.unstable
    assert empty.as_dict()["median"] is None


def test_one_value_is_never_unstable():
    spread = Spread.of([7.0])
    assert spread.relative == 0 and not spread.unstable
    assert spread.describe() == "7.00"


def test_spread_round_trips_through_its_record():
    spread = Spread.of([1.0, 1.1, 1.3])
    assert Spread.from_dict(spread.as_dict()) == Spread(1.1, 1.0, 1.3, 3)
    assert spread.describe(unit="x") == "1.10x (1.00-1.30x over 3 repeats)"


def test_ratio_spread_is_taken_per_repeat():
    # A disturbed second repeat slows both methods alike: its ratio stays 2.
    spread = ratio_spread([10.0, 5.0, 9.0], [5.0, 2.5, 4.0])
    assert spread.median == 2.0 and spread.low == 2.0 and spread.high == 2.25
    assert ratio_spread([1.0], [0.0]).count == 0
    with pytest.raises(ValueError):
        ratio_spread([1.0, 2.0], [1.0])


def test_unstable_threshold():
    just_inside = Spread.of([1.0, 1.0 + UNSTABLE_SPREAD * 0.99])
    assert not just_inside.unstable
    assert Spread.of([1.0, 1.0 + UNSTABLE_SPREAD * 1.2]).unstable


@pytest.mark.parametrize(
    ("old", "new", "verdict"),
    [
        ([10.0, 10.2, 9.9], [12.0, 12.3, 11.8], "faster"),
        ([10.0, 10.2, 9.9], [8.0, 8.2, 7.9], "slower"),
        ([10.0, 12.0, 9.0], [11.0, 11.5, 10.5], "~"),  # ranges overlap
        ([10.0, 10.01], [10.3, 10.31], "~"),  # no overlap, but within the noise floor
        ([10.0], [11.0], "~"),  # one sample each: taken as UNSTABLE_SPREAD wide
        ([10.0], [13.0], "faster"),
    ],
)
def test_compare_marks_only_changes_larger_than_the_noise(old, new, verdict):
    change = compare(Spread.of(old), Spread.of(new))
    assert change.verdict == verdict
    assert change.ratio == pytest.approx(Spread.of(new).median / Spread.of(old).median)
    if verdict == "~":
        assert not change.significant
    else:
        assert abs(change.ratio - 1) > NOISE_FLOOR


def test_cpu_load_is_busy_past_the_threshold_and_round_trips():
    quiet = CpuLoad(2.0, BUSY_CPU_FRACTION / 2, 1.0, 0.3)
    busy = CpuLoad(2.0, 0.5, 40.0, 1.5)
    assert not quiet.busy and busy.busy
    assert "BUSY" in busy.describe() and "BUSY" not in quiet.describe()
    assert CpuLoad.from_dict(busy.as_dict()) == busy
    both = combined_load([quiet, CpuLoad(6.0, 0.5, 10.0, 1.0)])
    assert both.seconds == 8.0
    assert both.others_cpu_fraction == pytest.approx((2 * BUSY_CPU_FRACTION / 2 + 6 * 0.5) / 8)
    assert combined_load([]) is None


BUSY_LOOP = (
    "import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end: pass\n"
)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_monitor_sees_a_bounded_busy_loop_on_every_core():
    """Busy loops that stop by themselves, one pinned to each core, make the stretch busy."""
    cores = sorted(os.sched_getaffinity(0))
    with CpuMonitor() as monitor:
        loops = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                    + BUSY_LOOP.format(seconds=1.5),
                ]
            )
            for core in cores
        ]
        for loop in loops:
            loop.wait(timeout=60)
    assert monitor.load.busy, monitor.load
    assert monitor.load.others_cpu_fraction > BUSY_CPU_FRACTION


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_running_child_counts_as_the_process_own_where_asked():
    """A child server's work (still running, not waited for) is not another process's load."""
    from flyspec.support.machine import _own_cpu_seconds

    alone = _own_cpu_seconds(include_children=True)
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY_LOOP.format(seconds=0.6) + "import time; time.sleep(60)"]
    )
    try:
        time.sleep(1.5)  # the loop is done; the child sleeps on, running
        assert child.poll() is None
        with_child = _own_cpu_seconds(include_children=True)
        assert with_child - alone >= 0.4
        assert _own_cpu_seconds() - alone < 0.4
    finally:
        child.kill()
        child.wait()


def test_monitor_subtracts_its_own_cpu_time(monkeypatch):
    """Machine-wide busy time minus this process's, over wall time times cores."""
    from flyspec.support import machine

    clock = iter([100.0, 102.0])  # 2 s of wall time
    machine_busy = iter([50.0, 53.0])  # all cores were busy 3 CPU-seconds
    own = iter([10.0, 11.0])  # of which this process used 1
    stall = iter([1.0, 1.5])
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(machine, "_machine_busy_seconds", lambda: next(machine_busy))
    monkeypatch.setattr(machine, "_own_cpu_seconds", lambda include_children: next(own))
    monkeypatch.setattr(machine, "_stall", lambda: next(stall))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    load = CpuMonitor().start().stop()
    assert load.others_cpu_fraction == pytest.approx(2.0 / (2.0 * 2))
    assert load.pressure_percent == pytest.approx(25.0)
    assert load.busy


def test_machine_identity_names_cpu_extensions_torch_and_version():
    identity = machine_identity()
    for name in ("cpu_model", "cpu_family", "vector_extensions", "cores", "torch", "flyspec"):
        assert name in identity
    assert identity["torch_threads"] >= 1
    line = describe_machine(identity)
    assert "cores" in line and "torch" in line


def test_the_commit_is_the_checkouts_own_or_the_one_a_copy_names(tmp_path):
    root = Path(__file__).resolve().parents[1]
    described = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert git_commit() == described and described
    # A copy of the tree inside another repository: not that repository's commit.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    copy = tmp_path / "flyspec"
    copy.mkdir()
    assert git_commit(copy) is None
    (copy / TREE_COMMIT_FILE).write_text("57a2ced1234a-dirty\n")
    assert git_commit(copy) == "57a2ced1234a-dirty"
