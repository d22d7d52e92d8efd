"""Whether llama.cpp decodes faster with its buffers on transparent huge pages: the default
target's GGUF decoded greedily (a bare Python loop over flyspec's llama.cpp runner) in fresh
processes, alternately as the process starts by default and with glibc told to advise huge
pages for the memory it maps (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; the kernel's
transparent huge pages in ``madvise`` mode, as is common, give none otherwise)::

    .venv/bin/python benchmarks/llamacpp_huge_pages.py [--processes 3] [--tokens 100]

Prints, per process, milliseconds per new token (the median of three decodes of a 250-token
prompt) and the anonymous memory on huge pages after loading. llama.cpp's weights repacked
for the CPU, its KV cache and its compute buffers are anonymous memory; the GGUF file stays
mapped (its page cache may be on large folios either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flyspec.support.huge_pages import with_huge_pages  # noqa: E402


def child(tokens: int) -> None:
    """One process: load, decode three times, print a JSON line."""
    from bare_decode import bare_decode_seconds, random_prompt

    from flyspec.config import LlamaCppConfig
    from flyspec.models.default_pair import default_gguf_paths
    from flyspec.models.llamacpp import LlamaCppForward

    runner = LlamaCppForward(default_gguf_paths().target, context=LlamaCppConfig().context)
    prompt = random_prompt(250)
    ms = statistics.median(bare_decode_seconds(runner, prompt, tokens) * 1000 for _ in range(3))
    huge_kib = next(
        int(line.split()[1])
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
        if line.startswith("AnonHugePages:")
    )
    print(json.dumps({"ms_per_token": ms, "anon_huge_mib": huge_kib // 1024}))


def run_child(tokens: int, *, huge_pages: bool) -> dict:
    env = with_huge_pages(os.environ) if huge_pages else dict(os.environ)
    command = [sys.executable, __file__, "--child", "--tokens", str(tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3, help="processes of each kind")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.tokens)
        return 0
    from flyspec.support.machine import describe_machine, machine_identity

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(describe_machine(machine_identity()))
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'unknown'}")
    print(f"250-token prompt, {args.tokens} new tokens; ms per new token, fresh processes\n")
    print("| process | default | huge pages | huge / default | on huge pages (MiB) |")
    print("|---:|---:|---:|---:|---:|")
    ratios = []
    for index in range(args.processes):
        default = run_child(args.tokens, huge_pages=False)
        huge = run_child(args.tokens, huge_pages=True)
        ratio = huge["ms_per_token"] / default["ms_per_token"]
        ratios.append(ratio)
        print(
            f"| {index + 1} | {default['ms_per_token']:.2f} | {huge['ms_per_token']:.2f} | "
            f"{ratio:.3f} | {default['anon_huge_mib']} / {huge['anon_huge_mib']} |"
        )
    print(f"\nmedian huge / default: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
