"""Plain decoding and the edit path through the servers, end to end, every setting a fresh
server in every pass: llama.cpp's ``llama-server`` (plain, and with each of its n-gram
speculations) beside ``flyspec serve --backend llamacpp`` (mode target, and the edit path: the
code as the request's ``prediction``, exact verification, ``-k auto``)::

    .venv/bin/python benchmarks/served_passes.py [--passes 3] [--limit 8] [--max-tokens 384]

The requests are the first ``--limit`` humaneval-edit problems (chat, greedy, up to
``--max-tokens`` new tokens), sent through the ``openai`` client one after another, after one
untimed short request on another prompt (so that no server's first request pays for its
start). In each pass every setting starts as a new process, in an order rotated by one
setting a pass, and is stopped before the next starts; llama-server on the target's GGUF file
with flyspec's llama.cpp threads and context, as ``flyspec bench`` runs it, and ``flyspec
serve`` as its console script starts (``python -m flyspec``). A setting's speed in a pass is
its completion tokens over the seconds its requests took; its ratio over llama-server's is
taken per pass, and the table gives the medians over the passes with their ranges. About 25
minutes on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from served import PassRun, llama_serving, serving, timed_pass  # noqa: E402

from flyspec.bench.prompts import BenchPrompt, dataset_prompts  # noqa: E402
from flyspec.support.machine import cpuinfo, git_commit  # noqa: E402

FLYSPEC = ("--backend", "llamacpp", "--no-draft")


@dataclass(frozen=True)
class Setting:
    """A server as started (``llama-server`` or ``flyspec serve`` with ``arguments``), and
    whether its requests carry the problem's code as their ``prediction``."""

    server: str
    arguments: tuple[str, ...] = ()
    predicted: bool = False

    def __str__(self) -> str:
        shown = [self.server if self.server == "llama-server" else "flyspec serve"]
        return " ".join([*shown, *self.arguments]) + (
            ", the code as the prediction" if self.predicted else ""
        )


SETTINGS = {
    "llama-server": Setting("llama-server"),
    "llama-server-ngram-mod": Setting("llama-server", ("--spec-type", "ngram-mod")),
    "llama-server-ngram-simple@16": Setting(
        "llama-server", ("--spec-type", "ngram-simple", "--spec-draft-n-max", "16")
    ),
    "flyspec-target": Setting("flyspec", (*FLYSPEC, "--mode", "target")),
    "flyspec-predict@auto": Setting(
        "flyspec", (*FLYSPEC, "--mode", "spd", "--drafter", "ngram", "-k", "auto"), True
    ),
}
"""The settings by the names of ``flyspec bench``'s methods that run the same."""
BASELINE = "llama-server"


def run_setting(setting: Setting, prompts: list[BenchPrompt], *, max_tokens: int) -> PassRun:
    """``setting`` started fresh, warmed up with one short request, then timed on every
    prompt, and stopped."""
    if setting.server == "llama-server":
        server = llama_serving(setting.arguments)
    else:
        server = serving(setting.arguments, start_seconds=300)
    with server as url:
        return timed_pass(
            url, prompts, max_tokens=max_tokens, predicted=setting.predicted, warm_up=True
        )


def median_and_range(values: list[float], unit: str = "") -> str:
    """``11.64 (11.59-11.72)``, or the one value of a single pass."""
    if len(values) == 1:
        return f"{values[0]:.2f}{unit}"
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def table(runs: dict[str, list[PassRun]]) -> str:
    """Markdown: each setting's speed, its ratio over llama-server's per pass, the share of the
    time end to end that the server says it spent reading and decoding (the median over the
    passes; the rest is HTTP, the chat template, tokenizing and waiting), and how many of its
    answers are llama-server's."""
    baseline = runs[BASELINE]
    lines = [
        "| server, setting | tok/s | over llama-server | per pass | the server's own time | "
        "same answers as llama-server |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, passes in runs.items():
        ratios = [
            run.tokens_per_second / base.tokens_per_second
            for run, base in zip(passes, baseline, strict=True)
        ]
        same = sum(
            mine == theirs
            for run, base in zip(passes, baseline, strict=True)
            for mine, theirs in zip(run.answers, base.answers, strict=True)
        )
        total = sum(len(run.answers) for run in passes)
        speeds = [run.tokens_per_second for run in passes]
        own = statistics.median(run.server_seconds / run.seconds for run in passes)
        lines.append(
            f"| `{SETTINGS[name]}` | {median_and_range(speeds)} | "
            f"{median_and_range(ratios, 'x')} | {', '.join(f'{r:.3f}' for r in ratios)} | "
            f"{own:.1%} | {same}/{total} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated, from: {', '.join(SETTINGS)} (llama-server always runs)",
    )
    parser.add_argument("--output", type=Path, help="also write every pass's runs as JSON here")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SETTINGS]
    if unknown or args.passes < 1 or args.limit < 1 or args.max_tokens < 1:
        parser.error(
            f"unknown setting(s) {unknown}" if unknown else "passes, limit, max-tokens >= 1"
        )
    names = [BASELINE, *(name for name in chosen if name != BASELINE)]
    prompts = dataset_prompts("humaneval-edit", limit=args.limit, chat=True)
    runs: dict[str, list[PassRun]] = {name: [] for name in names}
    for number in range(args.passes):
        order = names[number % len(names) :] + names[: number % len(names)]
        for name in order:
            print(f"pass {number + 1}/{args.passes}: {name}", file=sys.stderr, flush=True)
            run = run_setting(SETTINGS[name], prompts, max_tokens=args.max_tokens)
            runs[name].append(run)
            print(
                f"  {run.tokens} tokens in {run.seconds:.1f} s: {run.tokens_per_second:.2f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    cpu = cpuinfo()
    print(
        f"commit {git_commit(ROOT)}, CPU {cpu.get('model name', platform.machine())} (family "
        f"{cpu.get('cpu family')}, model {cpu.get('model')}), {args.passes} passes, "
        f"{len(prompts)} humaneval-edit prompts, max_tokens {args.max_tokens}\n"
    )
    print(table(runs))
    if args.output:
        record = {name: [asdict(run) for run in passes] for name, passes in runs.items()}
        args.output.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
