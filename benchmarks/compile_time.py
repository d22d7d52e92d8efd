"""How long the compiled forward takes to compile, cold and warm, by depth of model.

Each model (the first-look script's configs and builder, ``first_look/models.py``, by default
narrowed as in its CPU rehearsal: ``gpu_first_look.py --rehearse``) is built with random
weights and compiled by :class:`flyspec.models.lean.LeanForward` in a process of its own, twice
over one inductor cache folder made empty for it: cold (inductor builds every kernel) and warm
(a second process, as a later run on the same machine). Each process compiles the two graphs a
model needs (a block, then one token) and then times the compiled and the eager one-token
forward::

    python benchmarks/compile_time.py                          # 24, 28 and 64 layers, bfloat16
    python benchmarks/compile_time.py --models 1.5b --dtype float32

It prints one Markdown table (the machine's CPU above it) and, with ``--json``, the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent / "src"))

DEFAULT_MODELS = ("0.5b", "1.5b", "32b")  # 24, 28 and 64 layers
PROMPT_TOKENS = 24
TIMED_FORWARDS = 15


def measure(name: str, *, dtype_name: str, shapes: str, threads: int) -> dict:
    """In this process: build model ``name``, compile its forward (a block, then one token)
    and time the compiled and eager one-token forwards (medians, ms)."""
    import torch
    from first_look.models import build_model, load_config
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    from flyspec.models.lean import LeanForward

    torch.set_num_threads(threads)
    config = load_config(name, shapes=shapes)
    dtype = getattr(torch, dtype_name)
    model = build_model(config, device=torch.device("cpu"), dtype=dtype, seed=0)
    ids = torch.randint(config.vocab_size, (1, PROMPT_TOKENS + 1), generator=torch.Generator())
    clear_compilation_metrics()
    compiled = LeanForward(model, compiled=True)
    eager = LeanForward(model)
    started = time.perf_counter()
    with torch.inference_mode():
        compiled.forward(ids[:, :PROMPT_TOKENS], 1)  # a block: its graph
        compiled.forward(ids[:, PROMPT_TOKENS:], 1)  # one token: its graph
        first_forwards = time.perf_counter() - started
        eager.forward(ids[:, :PROMPT_TOKENS], 1)
        token = ids[:, PROMPT_TOKENS:]
        timings = {}
        for label, runner in (("compiled", compiled), ("eager", eager)):
            samples = []
            for _ in range(TIMED_FORWARDS):
                runner.crop(PROMPT_TOKENS)
                tick = time.perf_counter()
                runner.forward(token, 1)
                samples.append(time.perf_counter() - tick)
            timings[label] = 1000 * statistics.median(samples)
    metrics = [m for m in get_compilation_metrics() if m.co_name]
    return {
        "model": name,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "dtype": dtype_name,
        "forward_path": compiled.forward_path,
        "graphs": len(metrics),
        "compile_s": [round(m.entire_frame_compile_time_s or 0.0, 2) for m in metrics],
        "from_cache": [
            bool(m.inductor_fx_local_cache_hit_count) and not m.inductor_fx_local_cache_miss_count
            for m in metrics
        ],
        "stages_s": exclusive_stages(metrics),
        "first_forwards_s": round(first_forwards, 2),
        "compiled_token_ms": round(timings["compiled"], 2),
        "eager_token_ms": round(timings["eager"], 2),
    }


STAGES = ("dynamo", "aot_autograd", "inductor", "inductor_code_gen")
"""dynamo's nested compile stages, outermost first: each one's time includes the next's."""


def exclusive_stages(metrics: list) -> dict[str, float]:
    """Seconds in each stage alone, summed over ``metrics`` (dynamo's records of one compile
    each): tracing (dynamo), AOT autograd, inductor's lowering and its code generation (the
    C++ or Triton compiler's)."""
    totals = [
        sum(getattr(m, f"{stage}_cumulative_compile_time_us") or 0 for m in metrics) / 1e6
        for stage in STAGES
    ]
    names = ("tracing", "aot_autograd", "lowering", "code_gen")
    alone = [outer - inner for outer, inner in zip(totals, totals[1:] + [0.0], strict=True)]
    return {name: round(t, 1) for name, t in zip(names, alone, strict=True)}


def run_child(name: str, args: argparse.Namespace, cache: Path) -> dict:
    """:func:`measure` in a new process over the inductor cache ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    command = [sys.executable, __file__, "--child", name, "--dtype", args.dtype]
    command += ["--shapes", args.shapes, "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"compiling {name} failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = [
        "| model | layers | graphs | cold: compile s (block, token) | warm: compile s | "
        "cold/warm | cold, by stage alone (s) | first forwards cold, warm | "
        "one token compiled / eager |",
        "|---|---:|---:|---|---|---:|---|---|---:|",
    ]
    for cold, warm in zip(rows[::2], rows[1::2], strict=True):
        ratio = sum(cold["compile_s"]) / max(sum(warm["compile_s"]), 1e-9)
        lines.append(
            f"| {cold['model']} ({cold['dtype']}, hidden {cold['hidden']}) | {cold['layers']} | "
            f"{cold['graphs']} | {', '.join(map(str, cold['compile_s']))} | "
            f"{', '.join(map(str, warm['compile_s']))} | {ratio:.1f}x | "
            + ", ".join(f"{stage} {t}" for stage, t in cold["stages_s"].items())
            + " | "
            f"{cold['first_forwards_s']} s, {warm['first_forwards_s']} s | "
            f"{warm['compiled_token_ms']} / {warm['eager_token_ms']} ms |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="of 0.5b,1.5b,7b,32b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--shapes", default="rehearsal", choices=("rehearsal", "real", "tiny"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        figures = measure(
            args.child, dtype_name=args.dtype, shapes=args.shapes, threads=args.threads
        )
        print(json.dumps(figures))
        return 0
    from flyspec.support.machine import describe_machine, machine_identity

    rows = []
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            for state in ("cold", "warm"):
                print(f"[compile_time] {name}, {state} ...", file=sys.stderr, flush=True)
                rows.append(run_child(name, args, Path(cache)) | {"state": state})
    print(f"{describe_machine(machine_identity())}; {args.threads} threads in each compile")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
