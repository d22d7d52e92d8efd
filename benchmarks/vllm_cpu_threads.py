"""vLLM's CPU build with one core kept for its front end (its default) against every core
computing (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, what flyspec's vLLM commands set).

Each setting starts its own engine (the target alone, greedy, no prefix caching) in a child
process, one after another, and times one 64-token generation after a warm-up; the ratio is
printed. Run in vLLM's environment::

    .venv-vllm/bin/python benchmarks/vllm_cpu_threads.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "def quicksort(xs):"
NEW_TOKENS = 64


def measure(target: str) -> float:
    """Tokens/s of one generation in a fresh engine (run in the child process)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, enforce_eager=True, max_model_len=2048, enable_prefix_caching=False)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    output = llm.generate([PROMPT], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    llm.llm_engine.engine_core.shutdown()
    return len(output[0].outputs[0].token_ids) / seconds


def run_child(target: str, reserved: str | None) -> float:
    environment = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    environment.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    if reserved is not None:
        environment["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
    result = subprocess.run(
        [sys.executable, __file__, "--child", target],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument(
        "--model", "--target", dest="target", help="target model folder (default: the embedded one)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"tokens_per_second": measure(args.child)}))
        return
    from flyspec.models import default_pair_paths

    target = args.target or str(default_pair_paths().target)
    speeds: dict[str, list[float]] = {"vLLM default": [], "reserved 0": []}
    for _ in range(args.repeats):
        speeds["vLLM default"].append(run_child(target, None))
        speeds["reserved 0"].append(run_child(target, "0"))
    for name, values in speeds.items():
        print(f"{name:13s} " + " ".join(f"{v:.2f}" for v in values) + " tok/s")
    ratio = sum(speeds["reserved 0"]) / sum(speeds["vLLM default"])
    print(f"every core computing / vLLM's default: {ratio:.2f}x")


if __name__ == "__main__":
    main()
