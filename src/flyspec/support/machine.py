"""What machine a measurement ran on, and whether something else used its CPU meanwhile.

Every figure flyspec publishes is a speed ratio measured on a small, often shared machine.
:func:`machine_identity` names the machine fully (machines sold under one model name differ
by up to 3x); :class:`CpuMonitor` measures, over a timed stretch, how much of the machine's
CPU other processes took (from ``/proc/stat`` minus this process's own CPU time, steal time
counted as taken), with the load average and Linux's CPU pressure where they exist, and
calls the stretch *busy* past :data:`BUSY_CPU_FRACTION`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_CPU_FRACTION = 0.10
"""Other processes using more than this share of all cores make a measurement disturbed
(a busy loop on one of two cores is 0.5; an idle machine's daemons stay near 0.01)."""

VECTOR_EXTENSIONS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_PROC_STAT = Path("/proc/stat")
_PRESSURE = Path("/proc/pressure/cpu")


def machine_identity() -> dict:
    """CPU model, family/model/stepping, the vector extensions that matter, cores, torch's
    version and threads, and flyspec's version and commit."""
    import torch

    cpu = cpuinfo()
    flags = set(cpu.get("flags", "").split())
    return {
        "cpu_model": cpu.get("model name") or platform.processor() or None,
        "cpu_family": _int_or_none(cpu.get("cpu family")),
        "cpu_model_number": _int_or_none(cpu.get("model")),
        "cpu_stepping": _int_or_none(cpu.get("stepping")),
        "vector_extensions": [name for name in VECTOR_EXTENSIONS if name in flags],
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "flyspec": _flyspec_version(),
        "commit": git_commit(),
    }


def describe_machine(identity: dict) -> str:
    """One line naming the machine: model, family/model/stepping, extensions, cores, torch."""
    extensions = ", ".join(identity.get("vector_extensions") or ()) or "no AVX2"
    return (
        f"{identity.get('cpu_model')} (family {identity.get('cpu_family')}, model "
        f"{identity.get('cpu_model_number')}, stepping {identity.get('cpu_stepping')}; "
        f"{extensions}), {identity.get('cores')} cores, torch {identity.get('torch')} with "
        f"{identity.get('torch_threads')} threads, flyspec {identity.get('flyspec')}"
        + (f" at {identity['commit']}" if identity.get("commit") else "")
    )


@dataclass(frozen=True)
class CpuLoad:
    """What other processes did to the CPU over ``seconds`` of wall time.

    ``others_cpu_fraction``: the share of all cores' time used by other processes (and stolen
    by the hypervisor); ``pressure_percent``: the share of wall time some task waited for a CPU
    (``/proc/pressure/cpu``, ours included); ``load_average``: the 1-minute load at the end.
    None where the machine does not say.
    """

    seconds: float
    others_cpu_fraction: float | None
    pressure_percent: float | None
    load_average: float | None

    @property
    def busy(self) -> bool:
        return (self.others_cpu_fraction or 0.0) > BUSY_CPU_FRACTION

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 3),
            "others_cpu_fraction": _rounded(self.others_cpu_fraction),
            "pressure_percent": _rounded(self.pressure_percent, 2),
            "load_average": self.load_average,
            "busy": self.busy,
            "busy_threshold": BUSY_CPU_FRACTION,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CpuLoad:
        """The load :meth:`as_dict` recorded."""
        return cls(
            data["seconds"],
            data.get("others_cpu_fraction"),
            data.get("pressure_percent"),
            data.get("load_average"),
        )

    def describe(self) -> str:
        if self.others_cpu_fraction is None:
            return "other processes' CPU use unknown (no /proc/stat)"
        text = f"other processes used {self.others_cpu_fraction:.0%} of the CPU"
        if self.pressure_percent is not None:
            text += f", CPU pressure {self.pressure_percent:.1f}%"
        if self.load_average is not None:
            text += f", load average {self.load_average:.2f}"
        if self.busy:
            text += f": BUSY (over {BUSY_CPU_FRACTION:.0%}), the figures may be disturbed"
        return text


class CpuMonitor:
    """Measures :class:`CpuLoad` between :meth:`start` and :meth:`stop` (or over a ``with``
    block, after which ``.load`` holds the result). ``include_children``: count the CPU time
    of this process's children as its own, those running (a llama-server, a vLLM engine) and
    those that ended and were waited for, for a measurement whose work runs in child
    processes."""

    def __init__(self, *, include_children: bool = False) -> None:
        self.include_children = include_children
        self.load: CpuLoad | None = None
        self._start: tuple[float, float | None, float, float | None] | None = None

    def start(self) -> CpuMonitor:
        own = _own_cpu_seconds(self.include_children)
        self._start = (time.perf_counter(), _machine_busy_seconds(), own, _stall())
        return self

    def stop(self) -> CpuLoad:
        if self._start is None:
            raise RuntimeError("CpuMonitor.stop() before start()")
        wall0, machine0, own0, stall0 = self._start
        wall = max(time.perf_counter() - wall0, 1e-9)
        machine1, stall1 = _machine_busy_seconds(), _stall()
        own1 = _own_cpu_seconds(self.include_children)
        others = None
        if machine0 is not None and machine1 is not None:
            taken = (machine1 - machine0) - (own1 - own0)
            others = min(max(taken / (wall * (os.cpu_count() or 1)), 0.0), 1.0)
        pressure = None
        if stall0 is not None and stall1 is not None:
            pressure = min(max(100.0 * (stall1 - stall0) / wall, 0.0), 100.0)
        self.load = CpuLoad(wall, others, pressure, _load_average())
        return self.load

    def __enter__(self) -> CpuMonitor:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def combined_load(loads: list[CpuLoad]) -> CpuLoad | None:
    """One :class:`CpuLoad` over several stretches, weighted by their wall time."""
    if not loads:
        return None
    seconds = sum(load.seconds for load in loads)

    def weighted(name: str) -> float | None:
        values = [(getattr(load, name), load.seconds) for load in loads]
        if any(value is None for value, _ in values):
            return None
        return sum(value * weight for value, weight in values) / seconds

    return CpuLoad(
        seconds,
        weighted("others_cpu_fraction"),
        weighted("pressure_percent"),
        loads[-1].load_average,
    )


def _machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent not idle since boot (user, nice, system, irq, softirq,
    steal), from the first line of /proc/stat."""
    try:
        fields = _PROC_STAT.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds(include_children: bool = False) -> float:
    """This process's CPU seconds, all its threads, and its children's if asked: those
    waited for and those still running."""
    times = os.times()
    own = times.user + times.system
    if not include_children:
        return own
    return own + times.children_user + times.children_system + _running_children_cpu_seconds()


def _running_children_cpu_seconds() -> float:
    """The CPU seconds of this process's running children (0 where /proc cannot say)."""
    ticks = os.sysconf("SC_CLK_TCK")
    # After the command's name: state, ppid, ..., utime and stime (the 12th and 13th).
    return sum(
        (int(fields[11]) + int(fields[12])) / ticks for fields in running_children().values()
    )


def running_children() -> dict[int, list[str]]:
    """This process's running children: pid -> the fields of ``/proc/PID/stat`` after the
    command's name (state, ppid, ...); empty where /proc cannot say."""
    parent, children = os.getpid(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # ended meanwhile
            continue
        if len(fields) > 12 and int(fields[1]) == parent:
            children[int(stat.parent.name)] = fields
    return children


def _stall() -> float | None:
    """Seconds some task waited for a CPU since boot (/proc/pressure/cpu, 'some' total)."""
    try:
        for line in _PRESSURE.read_text().splitlines():
            if line.startswith("some "):
                for part in line.split():
                    if part.startswith("total="):
                        return int(part[len("total=") :]) / 1e6
    except (OSError, ValueError):
        return None
    return None


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} elsewhere)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_identity() -> tuple[str, str]:
    """The CPU's model name and its feature flags (what a native build and the forwards'
    speed depend on)."""
    cpu = cpuinfo()
    return cpu.get("model name") or platform.machine(), cpu.get("flags") or cpu.get("Features", "")


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _flyspec_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flyspec")
    except PackageNotFoundError:
        return None


TREE_COMMIT_FILE = "TREE_COMMIT"
"""A file at the root of a copy of flyspec's tree that names the commit it was copied from
(``benchmarks/name_tree.sh`` writes it), for a copy that is no git checkout of its own."""


def git_commit(root: Path | None = None) -> str | None:
    """The commit of the source tree flyspec runs from (``root``, by default the folder above
    ``src/flyspec``): ``git describe`` where that tree is the root of its git checkout, else what
    its :data:`TREE_COMMIT_FILE` says (a copy of the tree, perhaps inside another repository,
    whose commit is not flyspec's); None where neither tells."""
    root = (root or Path(__file__).parents[3]).resolve()
    if _git(root, "rev-parse", "--show-toplevel") == str(root):
        return _git(root, "describe", "--always", "--dirty", "--abbrev=12")
    try:
        return (root / TREE_COMMIT_FILE).read_text().strip() or None
    except OSError:
        return None


def _git(folder: Path, *arguments: str) -> str | None:
    """What ``git -C folder ARGUMENTS`` prints (None where it fails)."""
    try:
        result = subprocess.run(
            ["git", "-C", str(folder), *arguments], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None
