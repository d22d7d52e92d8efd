"""What flyspec's decoding loop adds per token to llama.cpp's own forward, on the default
pair's target GGUF: the target alone, greedy, over the same prompt, timed three ways in one
process, interleaved:

- ``runner``: the llama.cpp runner's forward of one token and numpy's argmax of its logits,
  in a bare Python loop (about the least any caller of the binding pays);
- ``loop``: ``SpeculativeDecoder.stream`` in mode target (what ``flyspec bench`` times as
  ``llamacpp-flyspec-target``);
- ``engine``: ``Engine.stream``, the loop with its text decoded token by token (what
  ``flyspec serve`` runs).

    .venv/bin/python benchmarks/llamacpp_loop_overhead.py [--tokens N] [--repeats N] [--with-draft]

Prints milliseconds per new token (the prompt's forward left out), medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bare_decode import bare_decode_seconds, random_prompt  # noqa: E402

from flyspec.config import DecodeConfig, LlamaCppConfig  # noqa: E402
from flyspec.decoding.stats import RequestStats  # noqa: E402
from flyspec.engine import Engine  # noqa: E402
from flyspec.support.machine import describe_machine, machine_identity  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--with-draft", action="store_true", help="load the draft model too (as the bench does)"
    )
    args = parser.parse_args()
    engine = Engine.load(
        target=None,
        draft=None,
        with_draft=args.with_draft,
        backend="llamacpp",
        llamacpp=LlamaCppConfig(),
    )
    decoder, runner = engine.decoder, engine.decoder.target.runner
    prompt = random_prompt(args.prompt_tokens)
    config = DecodeConfig(mode="target", max_new_tokens=args.tokens)

    def bare() -> float:
        decoder.target.reset()
        return bare_decode_seconds(runner, prompt, args.tokens)

    def loop() -> float:
        decoder.target.reset()
        stats = RequestStats()
        tokens = [event.token for event in decoder.stream(prompt, config, stats=stats)]
        return (stats.seconds - stats.prefill_seconds) / len(tokens)

    def text() -> float:
        decoder.target.reset()
        stats = RequestStats()
        chunks = [
            chunk for chunk in engine.stream(prompt, config, stats=stats) if chunk.token is not None
        ]
        return (stats.seconds - stats.prefill_seconds) / len(chunks)

    timings: dict[str, list[float]] = {"runner": [], "loop": [], "engine": []}
    for _ in range(args.repeats):
        for name, run in (("runner", bare), ("loop", loop), ("engine", text)):
            timings[name].append(run() * 1000)
    print(f"{describe_machine(machine_identity())}")
    print(
        f"{args.prompt_tokens}-token prompt, {args.tokens} new tokens, median of "
        f"{args.repeats}{', the draft model loaded too' if args.with_draft else ''}; "
        "ms per new token\n"
    )
    print("| path | ms per token | over the runner |")
    print("|---|---:|---:|")
    floor = statistics.median(timings["runner"])
    for name, values in timings.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | +{median - floor:.2f} ms ({median / floor:.3f}x) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
