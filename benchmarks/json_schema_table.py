"""Structured outputs beside llama-server: the same chat requests with a JSON schema
(``response_format`` ``json_schema``, greedy) sent to llama.cpp's own server and to
``flyspec serve --backend llamacpp`` on the default pair's GGUF files, each setting in a fresh
child process (no prompt read before), end to end over HTTP.

    pip install jsonschema                     # checks every answer against its schema
    python benchmarks/json_schema_table.py     # about 15 minutes on 2 cores

Each request asks for a record drawn from a short text (a person, an order, an event, a
package, ...): the schema's fields, enums, arrays and bounds, as clients of structured outputs
send. Printed: per setting, its tokens per second pooled over the requests (the median of
``--passes`` passes), that over llama-server's, and the share of answers that parse and
validate against their schema.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from served import llama_serving, serving  # noqa: E402

from flyspec.support.machine import cpuinfo, git_commit  # noqa: E402


def record(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required or list(properties),
        "additionalProperties": False,
    }


TEXT = {"type": "string"}
TASKS = [
    (
        "Ada Lovelace (1815-1852) was an English mathematician who wrote in English and "
        "French. She worked with Charles Babbage on the Analytical Engine.",
        record(
            {
                "name": TEXT,
                "born": {"type": "integer"},
                "died": {"type": "integer"},
                "languages": {"type": "array", "items": TEXT},
                "collaborators": {"type": "array", "items": TEXT},
            }
        ),
    ),
    (
        "Order 4471: two boxes of green tea at 4.50 each and one teapot at 23.00, shipped "
        "to Lyon by express on 3 March.",
        record(
            {
                "order_id": {"type": "integer"},
                "items": {
                    "type": "array",
                    "items": record(
                        {
                            "product": TEXT,
                            "quantity": {"type": "integer", "minimum": 1},
                            "unit_price": {"type": "number"},
                        }
                    ),
                },
                "city": TEXT,
                "shipping": {"enum": ["standard", "express", "pickup"]},
            }
        ),
    ),
    (
        "PyCon US 2026 runs from May 13 to May 19 in Long Beach, California; tickets open "
        "in January and talks are in English.",
        record(
            {
                "event": TEXT,
                "start": {"type": "string", "format": "date"},
                "end": {"type": "string", "format": "date"},
                "city": TEXT,
                "country": TEXT,
            }
        ),
    ),
    (
        "The package requests 2.32.3 needs Python 3.8 or newer, depends on urllib3, idna, "
        "certifi and charset-normalizer, and is licensed Apache-2.0.",
        record(
            {
                "package": TEXT,
                "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                "python": TEXT,
                "dependencies": {"type": "array", "items": TEXT, "minItems": 1},
                "license": {"enum": ["MIT", "BSD-3-Clause", "Apache-2.0", "GPL-3.0"]},
            }
        ),
    ),
    (
        "def area(r):\n    return 3.14159 * r * r\n\nReview this function: is it correct, "
        "what would you rename, and how severe are the issues?",
        record(
            {
                "correct": {"type": "boolean"},
                "renames": {"type": "array", "items": record({"old": TEXT, "new": TEXT})},
                "issues": {"type": "array", "items": TEXT},
                "severity": {"enum": ["none", "low", "medium", "high"]},
            }
        ),
    ),
    (
        "The meeting with the design team moved from Tuesday 10:00 to Thursday 14:30, in "
        "room B2, for 45 minutes; Maria and Chen must attend, Omar is optional.",
        record(
            {
                "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "room": TEXT,
                "minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "required": {"type": "array", "items": TEXT},
                "optional": {"type": "array", "items": TEXT},
            }
        ),
    ),
    (
        "Error log: at 12:01 the disk /dev/sda1 reached 97% usage on host db-2; at 12:03 "
        "the service postgres restarted; at 12:07 usage fell to 71%.",
        record(
            {
                "host": TEXT,
                "events": {
                    "type": "array",
                    "items": record(
                        {
                            "time": TEXT,
                            "kind": {"enum": ["disk", "restart", "network", "other"]},
                            "detail": TEXT,
                        }
                    ),
                },
                "resolved": {"type": "boolean"},
            }
        ),
    ),
    (
        "A recipe for pancakes: 200 g flour, 2 eggs, 300 ml milk, a pinch of salt; whisk, "
        "rest 20 minutes, cook 2 minutes a side. Serves 4.",
        record(
            {
                "dish": TEXT,
                "servings": {"type": "integer"},
                "ingredients": {
                    "type": "array",
                    "items": record({"name": TEXT, "amount": TEXT}),
                },
                "steps": {"type": "array", "items": TEXT},
                "minutes": {"type": "integer"},
            }
        ),
    ),
]


def body(index: int, *, max_tokens: int, extra: dict) -> dict:
    text, schema = TASKS[index]
    return {
        "messages": [
            {"role": "user", "content": f"{text}\n\nAnswer with the record as JSON."},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"task{index}", "schema": schema, "strict": True},
        },
        **extra,
    }


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def valid(answer: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(answer), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def one_pass(url: str, *, max_tokens: int, extra: dict) -> tuple[float, float, list[bool]]:
    """Tokens, seconds and each answer's validity, over every task."""
    tokens = seconds = 0.0
    checks = []
    for index, (_, schema) in enumerate(TASKS):
        started = time.perf_counter()
        answer = post(url, body(index, max_tokens=max_tokens, extra=extra))
        seconds += time.perf_counter() - started
        tokens += answer["usage"]["completion_tokens"]
        choice = answer["choices"][0]
        checks.append(
            choice["finish_reason"] == "stop" and valid(choice["message"]["content"], schema)
        )
    return tokens, seconds, checks


SETTINGS = {
    "llama-server": None,
    "flyspec, mode target": {"mode": "target"},
    "flyspec, exact, -k auto": {"mode": "spd", "k": "auto"},
    "flyspec, FLy, -k auto": {"mode": "fly", "k": "auto"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    import jsonschema  # noqa: F401  (fails early, with pip's name, where it is missing)

    results: dict[str, list[tuple[float, float, list[bool]]]] = {name: [] for name in SETTINGS}
    for _ in range(args.passes):
        with llama_serving(["--jinja"]) as url:
            results["llama-server"].append(one_pass(url, max_tokens=args.max_tokens, extra={}))
        for name, extra in SETTINGS.items():
            if extra is None:
                continue
            with serving(["--backend", "llamacpp"]) as url:  # fresh: no prompt seen before
                results[name].append(one_pass(url, max_tokens=args.max_tokens, extra=extra))
    cpu = cpuinfo()
    print(
        f"commit {git_commit(ROOT)}, CPU {cpu.get('model name', platform.machine())} (family "
        f"{cpu.get('cpu family')}, model {cpu.get('model')}), {len(TASKS)} requests, "
        f"{args.passes} pass(es), max_tokens {args.max_tokens}"
    )
    rate = {
        name: statistics.median(tokens / seconds for tokens, seconds, _ in runs)
        for name, runs in results.items()
    }
    print("\n| setting | tok/s | over llama-server | valid answers | tokens |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        checks = [check for _, _, checks in runs for check in checks]
        tokens = statistics.mean(tokens for tokens, _, _ in runs)
        print(
            f"| {name} | {rate[name]:.2f} | {rate[name] / rate['llama-server']:.2f}x | "
            f"{sum(checks)}/{len(checks)} | {tokens:.0f} |"
        )


if __name__ == "__main__":
    main()
