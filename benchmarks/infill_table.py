"""Autocompletion beside llama-server: the same fill-in-the-middle requests sent to
llama-server's ``/infill`` and to ``flyspec serve``'s, as an editor plugin sends them::

    .venv/bin/python benchmarks/infill_table.py [--limit 8] [--passes 2] [--max-tokens 64]

Each request is a HumanEval problem with a gap: the prompt and the solution's first line before
it (``input_prefix``), the solution's last two lines after it (``input_suffix``), the prompts
of the problems before and after it as the project's files (``input_extra``), greedy, at most
``--max-tokens`` tokens. Both servers run the default target's Q4_K_M GGUF on llama.cpp
with the same threads and context, each as a child on a free port; flyspec decodes with the
target alone, and with prompt lookup at ``-k auto`` (the n-grams of the code around the gap).
The servers take turns in each pass; every request's end-to-end seconds are timed, and the
table gives, per setting, the median over the requests of each one's median over the passes,
its ratio to llama-server's, the tokens per second pooled over all, and on how many requests
the text was llama-server's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from served import llama_serving, serving  # noqa: E402

from flyspec.support.datasets import load_humaneval  # noqa: E402
from flyspec.support.machine import describe_machine, machine_identity  # noqa: E402

SETTINGS = {
    "llama-server": None,
    "flyspec, mode target": {"mode": "target"},
    "flyspec, prompt lookup, exact, -k auto": {"mode": "spd", "drafter": "ngram", "k": "auto"},
}
"""Each setting and the fields flyspec's requests add (None: llama-server)."""


def requests(limit: int, max_tokens: int) -> list[dict]:
    """One /infill body per problem, with its neighbours' prompts as the project's files."""
    problems = load_humaneval()[:limit]
    bodies = []
    for index, problem in enumerate(problems):
        lines = problem.canonical_solution.rstrip("\n").split("\n")
        head, tail = lines[:1], lines[-2:] if len(lines) > 3 else lines[-1:]
        neighbours = [(index - 1) % len(problems), (index + 1) % len(problems)]
        files = [
            {"filename": f"problem_{other}.py", "text": problems[other].prompt}
            for other in dict.fromkeys(neighbours)
            if other != index
        ]
        bodies.append(
            {
                "input_prefix": problem.prompt + "\n".join(head) + "\n",
                "input_suffix": "\n".join(tail) + "\n",
                "input_extra": files,
                "n_predict": max_tokens,
                "temperature": 0,
                "cache_prompt": True,
            }
        )
    return bodies


def post(url: str, body: dict) -> tuple[float, dict]:
    request = urllib.request.Request(
        f"{url}/infill",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - started, answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    bodies = requests(args.limit, args.max_tokens)
    seconds: dict[str, list[list[float]]] = {name: [[] for _ in bodies] for name in SETTINGS}
    tokens: dict[str, list[int]] = {name: [0] * len(bodies) for name in SETTINGS}
    texts: dict[str, list[str]] = {name: [""] * len(bodies) for name in SETTINGS}
    for number in range(args.passes):
        for name, fields in SETTINGS.items():
            print(f"pass {number + 1}/{args.passes}: {name}", file=sys.stderr, flush=True)
            server = llama_serving() if fields is None else serving(["--backend", "llamacpp"])
            with server as url:
                post(url, {**bodies[0], "n_predict": 4})  # a warm-up, not timed
                for index, body in enumerate(bodies):
                    spent, answer = post(url, {**body, **(fields or {})})
                    seconds[name][index].append(spent)
                    tokens[name][index] = answer["timings"]["predicted_n"]
                    texts[name][index] = answer["content"]
    print(describe_machine(machine_identity()))
    print(
        f"{len(bodies)} /infill requests, at most {args.max_tokens} new tokens, greedy, "
        f"{args.passes} passes; seconds end to end\n"
    )
    print("| setting | median s a request | speed over llama-server | tok/s pooled | same text |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for name in SETTINGS:
        medians = [statistics.median(times) for times in seconds[name]]
        median = statistics.median(medians)
        base = base or median
        pooled = sum(tokens[name]) / sum(medians)
        same = sum(a == b for a, b in zip(texts[name], texts["llama-server"], strict=True))
        print(
            f"| {name} | {median:.3f} | {base / median:.2f}x | {pooled:.2f} | "
            f"{same}/{len(bodies)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
