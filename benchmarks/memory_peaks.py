"""Peak resident memory of ``flyspec generate`` on the default pair under each kernel setting,
and of ``flyspec serve`` after its first request, against the bytes of the weights loaded.

    python benchmarks/memory_peaks.py                      # every setting, a markdown table
    python benchmarks/memory_peaks.py --settings "target;fly" --flyspec .venv/bin/flyspec

Each setting runs in its own process (one at a time: memory), measured by ``/usr/bin/time``'s
maximum resident set size. The weights are the float32 checkpoints' bytes (parameters x 4,
from the safetensors headers): the target's, plus the draft's where the mode drafts with it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from flyspec.models import default_pair_paths  # noqa: E402
from flyspec.models.checkpoint import checkpoint_parameters  # noqa: E402
from flyspec.support.child_server import ChildServer  # noqa: E402
from flyspec.support.resident_memory import gib  # noqa: E402

PROMPT = "def fib(n):"
SETTINGS = {
    "target": ["--mode", "target"],
    "target, --linear default": ["--mode", "target", "--linear", "default"],
    "target, --target-quant fp16": ["--mode", "target", "--target-quant", "fp16"],
    "target, --target-quant int8": ["--mode", "target", "--target-quant", "int8"],
    "fly": [],
    "fly, --linear default": ["--linear", "default"],
    "fly, --draft-quant none": ["--draft-quant", "none"],
    "fly, --draft-quant fp16": ["--draft-quant", "fp16"],
}


def generate_peak(flyspec: str, arguments: list[str]) -> int:
    """The maximum resident set size of one ``flyspec generate`` run, in bytes."""
    with tempfile.NamedTemporaryFile("r") as report:
        command = ["/usr/bin/time", "-f", "%M", "-o", report.name, flyspec, "generate"]
        command += [PROMPT, "--max-tokens", "32", "--json", *arguments]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return int(report.read().strip().splitlines()[-1]) * 1024


def serve_peak(flyspec: str) -> int:
    """The resident high-water mark of ``flyspec serve`` after its first chat request."""

    def command(port: int) -> list[str]:
        return [flyspec, "serve", "--port", str(port), "--log-level", "warning"]

    with ChildServer("flyspec serve", command) as server:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32}
        request = urllib.request.Request(
            f"{server.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=600).read()
        status = Path(f"/proc/{server.process.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flyspec", default=".venv/bin/flyspec", help="the command to measure")
    parser.add_argument(
        "--settings",
        default=";".join([*SETTINGS, "serve"]),
        help=f"separated by ';', among: {'; '.join(SETTINGS)}; serve",
    )
    args = parser.parse_args()
    pair = default_pair_paths()
    target_bytes = 4 * checkpoint_parameters(pair.target)
    draft_bytes = 4 * checkpoint_parameters(pair.draft)
    print(f"weights (float32): target {gib(target_bytes)} GiB, draft {gib(draft_bytes)} GiB")
    print("| setting | peak RSS GiB | float32 weights loaded GiB | ratio |")
    print("|---|---:|---:|---:|")
    for name in args.settings.split(";"):
        name = name.strip()
        if name == "serve":
            peak, weights = serve_peak(args.flyspec), target_bytes + draft_bytes
        else:
            peak = generate_peak(args.flyspec, SETTINGS[name])
            weights = target_bytes + (0 if name.startswith("target") else draft_bytes)
        print(f"| {name} | {gib(peak)} | {gib(weights)} | {peak / weights:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
