"""What the HTTP server costs: the same prompts decoded by a plain process (what
``flyspec generate --json`` does) and by a ``flyspec serve`` process through
``/v1/completions``, in alternating blocks, one model-loading process at a time.

Each repeat runs one block of each kind, their order alternating (direct, server, server,
direct, ...): a block loads the pair once in a fresh process, warms it up with one short
generation, then decodes every prompt. For each prompt it records the engine's own time
(``stats.seconds`` directly, the response's ``speculative.seconds`` through the server) and
checks that both paths emitted the same text, then prints the ratio server / direct::

    .venv/bin/python benchmarks/serve_overhead.py --prompts 3 --repeats 2 [--stream]

Model options (``--target``, ``--draft``, ``--dtype``, kernels) are passed to both kinds of
process. Exit status 0, 1 where the two paths' texts differ, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from served import serving

from flyspec import config as cfg
from flyspec.cli import options as cli
from flyspec.support.cpu_math import configure_cpu_math

MODEL_FLAGS = {
    "target": "--model",
    "draft": "--draft-model",
    **{
        name: f"--{name.replace('_', '-')}"
        for name in ("device", "dtype", "linear", "draft_quant", "target_quant")
    },
}
"""The model options the child processes are given, by destination: their flags."""
WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_model_arguments(parser)
    cli.add_backend_arguments(parser)
    parser.add_argument("--prompts", type=int, default=3, help="HumanEval prompts (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="blocks of each (default 2)")
    flags, settings = cli.max_tokens_option(default=128, help="default 128")
    cli.add_option(parser, *flags, **settings)
    parser.add_argument("--mode", choices=cfg.MODES, default="fly")
    parser.add_argument("--drafter", choices=cfg.DRAFTERS, default="model")
    parser.add_argument("--stream", action="store_true", help="stream the server's answers")
    parser.add_argument("--json", action="store_true", help="print the samples as JSON too")
    parser.add_argument("--direct-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        parser.error("--prompts, --repeats and --max-tokens must be >= 1")
    return args


def model_arguments(args: argparse.Namespace) -> list[str]:
    """The model options as command-line flags, for the child processes."""
    flags = []
    for name, flag in MODEL_FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            flags += [flag, str(value)]
    return flags + ["--forward", args.forward]


def prompt_texts(count: int) -> list[str]:
    from flyspec.bench.prompts import dataset_prompts

    return [p.raw for p in dataset_prompts("humaneval", limit=count, chat=False)]


def decode_config(args: argparse.Namespace) -> cfg.DecodeConfig:
    return cfg.DecodeConfig(
        mode=args.mode, drafter=args.drafter, max_new_tokens=args.max_new_tokens
    )


def direct_worker(args: argparse.Namespace) -> int:
    """In a plain process: load, warm up, decode every prompt; one JSON line per prompt."""
    config = decode_config(args)
    engine = cli.load_engine(args, with_draft=config.uses_draft_model)
    prompts = [engine.encode(text) for text in prompt_texts(args.prompts)]
    engine.generate(prompts[0], config.with_updates(max_new_tokens=WARMUP_TOKENS))
    for ids in prompts:
        result = engine.generate(ids, config)
        record = {
            "text": result.text,
            "tokens": result.stats.emitted,
            "engine_seconds": result.stats.seconds,
            "rounds": result.stats.num_rounds,
        }
        print(json.dumps(record), flush=True)
    return 0


def direct_block(args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, __file__, "--direct-worker", *common_flags(args)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def common_flags(args: argparse.Namespace) -> list[str]:
    return [
        *model_arguments(args),
        "--prompts",
        str(args.prompts),
        "--max-tokens",
        str(args.max_new_tokens),
        "--mode",
        args.mode,
        "--drafter",
        args.drafter,
    ]


def server_block(args: argparse.Namespace) -> list[dict]:
    """Start ``flyspec serve``, warm it up, send every prompt, stop it."""
    arguments = [*model_arguments(args), "--mode", args.mode, "--drafter", args.drafter]
    with serving(arguments) as url:
        texts = prompt_texts(args.prompts)
        complete(url, texts[0], WARMUP_TOKENS, stream=args.stream)
        return [complete(url, text, args.max_new_tokens, stream=args.stream) for text in texts]


def complete(url: str, prompt: str, max_tokens: int, *, stream: bool) -> dict:
    """One completion through the server: its text and the engine's seconds."""
    import httpx

    payload = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    with httpx.Client(base_url=url, timeout=600) as client:
        if not stream:
            final = client.post("/v1/completions", json=payload).raise_for_status().json()
            text = final["choices"][0]["text"]
        else:
            pieces, final = [], None
            with client.stream("POST", "/v1/completions", json=payload) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk.get("choices"):
                        pieces.append(chunk["choices"][0].get("text") or "")
                    if "speculative" in chunk:
                        final = chunk
            text = "".join(pieces)
    return {
        "text": text,
        "tokens": final["usage"]["completion_tokens"],
        "engine_seconds": final["speculative"]["seconds"],
        "rounds": final["speculative"].get("rounds"),
    }


def main(argv: list[str] | None = None) -> int:
    configure_cpu_math()  # as the flyspec command does, before torch loads
    args = parse_args(argv)
    if args.direct_worker:
        return direct_worker(args)
    from flyspec.support.machine import CpuMonitor, describe_machine, machine_identity

    runs: dict[str, list[list[dict]]] = {"direct": [], "server": []}
    with CpuMonitor(include_children=True) as monitor:
        for repeat in range(args.repeats):
            order = ["direct", "server"] if repeat % 2 == 0 else ["server", "direct"]
            for kind in order:
                print(f"repeat {repeat + 1}/{args.repeats}: {kind} block ...", file=sys.stderr)
                block = direct_block(args) if kind == "direct" else server_block(args)
                runs[kind].append(block)

    samples = [
        {"prompt": index, "repeat": repeat, "direct": d, "server": s}
        for repeat in range(args.repeats)
        for index, (d, s) in enumerate(
            zip(runs["direct"][repeat], runs["server"][repeat], strict=True)
        )
    ]
    ratios = [s["server"]["engine_seconds"] / s["direct"]["engine_seconds"] for s in samples]
    differ = [s for s in samples if s["direct"]["text"] != s["server"]["text"]]
    print(f"machine: {describe_machine(machine_identity())}")
    print(f"during the run {monitor.load.describe()}")
    print(
        f"{len(samples)} samples ({args.prompts} HumanEval prompts x {args.repeats} repeats, "
        f"mode {args.mode}, drafter {args.drafter}, {args.max_new_tokens} new tokens, "
        f"{'streamed' if args.stream else 'not streamed'}; threads: "
        f"{os.environ.get('OMP_NUM_THREADS', 'torch default')})"
    )
    print("| prompt | repeat | tokens | rounds | direct s | server s | server/direct |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for sample, ratio in zip(samples, ratios, strict=True):
        d, s = sample["direct"], sample["server"]
        print(
            f"| {sample['prompt']} | {sample['repeat']} | {d['tokens']}/{s['tokens']} | "
            f"{d['rounds']}/{s['rounds']} | {d['engine_seconds']:.2f} | "
            f"{s['engine_seconds']:.2f} | {ratio:.3f} |"
        )
    print(
        f"generation time through the server / direct: median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    if args.json:
        print(json.dumps({"samples": samples, "machine_load": monitor.load.as_dict()}))
    if differ:
        print(f"texts differ on {len(differ)} samples", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
