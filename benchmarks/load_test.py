"""A bounded load test for a running ``flyspec serve`` on this machine (loopback only).

Sends a fixed number of requests with a fixed number in flight, stops by itself after
``--time-limit`` seconds at the latest, and reports throughput, latency percentiles and how the
requests ended::

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --requests 40 --concurrency 8

With ``--retries N`` a request refused with 429/503 waits as long as the response's
``Retry-After`` asks (at most ``--max-retry-wait`` seconds) and is sent again, up to N times:
the report then gives both the refusal rate (refused attempts over all attempts) and the
goodput (completed requests and their tokens per second).

Exit status: 0 when every request completed or was refused with 429/503 (a busy server is
not a failure); 1 on any other 5xx, on any other 4xx, on a transport error, on a stream that
ended with an error chunk, or on a request still unfinished at the time limit; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

DEFAULT_PROMPT = "def fibonacci(n):\n    "


@dataclass
class Outcome:
    """How one request ended."""

    kind: str  # ok, busy_429, busy_503, client_error, server_error, transport, stream_error
    status: int | None = None
    seconds: float = 0.0
    first_token_seconds: float | None = None
    completion_tokens: int = 0
    tau: float | None = None
    detail: str = ""
    retry_after: float | None = None  # seconds the server asked to wait (refusals only)
    attempts: int = 1
    refusals: int = 0  # attempts refused with 429/503, this one included if it is a refusal


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    unfinished: int = 0
    wall_seconds: float = 0.0

    @property
    def counts(self) -> Counter:
        counts = Counter(o.kind for o in self.outcomes)
        counts["unfinished"] = self.unfinished
        return counts

    @property
    def failed(self) -> bool:
        counts = self.counts
        return any(counts[k] for k in ("client_error", "server_error", "transport", "stream_error"))

    def as_dict(self) -> dict:
        ok = [o for o in self.outcomes if o.kind == "ok"]
        latencies = sorted(o.seconds for o in ok)
        first_tokens = sorted(o.first_token_seconds for o in ok if o.first_token_seconds)
        taus = [o.tau for o in ok if o.tau is not None]
        tokens = sum(o.completion_tokens for o in ok)
        wall = self.wall_seconds or math.nan
        statuses = Counter(str(o.status) for o in self.outcomes if o.status is not None)
        attempts = sum(o.attempts for o in self.outcomes)
        refusals = sum(o.refusals for o in self.outcomes)
        return {
            "requests": len(self.outcomes) + self.unfinished,
            "attempts": attempts,
            "refusal_rate": round(refusals / attempts, 4) if attempts else None,
            "counts": {
                "2xx": self.counts["ok"],
                "429": self.counts["busy_429"],
                "503": self.counts["busy_503"],
                "other_4xx": self.counts["client_error"],
                "other_5xx": self.counts["server_error"],
                "transport_errors": self.counts["transport"],
                "stream_errors": self.counts["stream_error"],
                "unfinished": self.unfinished,
            },
            "statuses": dict(sorted(statuses.items())),
            "wall_seconds": round(self.wall_seconds, 3),
            "goodput_requests_per_second": round(len(ok) / wall, 3),
            "goodput_tokens_per_second": round(tokens / wall, 3),
            "completion_tokens": tokens,
            "latency_seconds": _percentiles(latencies),
            "first_token_seconds": _percentiles(first_tokens) if first_tokens else None,
            "mean_tau": round(sum(taus) / len(taus), 3) if taus else None,
            "failures": [o.detail for o in self.outcomes if o.detail][:10],
        }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    return {
        name: (round(_quantile(values, q), 4) if values else None)
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    } | {"max": round(max(values), 4) if values else None}


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def is_loopback(url: str) -> bool:
    """Whether the URL's host is this machine (``flyspec serve``'s own rule)."""
    from flyspec.server.access import is_loopback as is_loopback_host

    return is_loopback_host(urlsplit(url).hostname or "")


def build_payload(args: argparse.Namespace, index: int) -> dict:
    payload: dict = {"max_tokens": args.max_tokens, "stream": args.stream}
    if args.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        payload["prompt"] = args.prompt
    if args.temperature is not None:
        payload["temperature"] = args.temperature
        payload["seed"] = index
    for name in ("mode", "drafter", "k", "window", "theta"):
        value = getattr(args, name)
        if value is not None:
            payload[name] = value
    return payload


async def request_with_retries(
    client: httpx.AsyncClient,
    path: str,
    payload: dict,
    *,
    retries: int = 0,
    max_retry_wait: float = 30.0,
) -> Outcome:
    """One request, sent again up to ``retries`` times after a 429/503, each time after the
    wait its ``Retry-After`` asks for (1 s where it gives none, at most ``max_retry_wait``)."""
    refusals = 0
    for attempt in range(1, retries + 2):
        outcome = await one_request(client, path, payload)
        refused = outcome.kind in ("busy_429", "busy_503")
        refusals += refused
        if not refused or attempt > retries:
            break
        wait = 1.0 if outcome.retry_after is None else outcome.retry_after
        await asyncio.sleep(min(max(wait, 0.0), max_retry_wait))
    outcome.attempts, outcome.refusals = attempt, refusals
    return outcome


async def one_request(client: httpx.AsyncClient, path: str, payload: dict) -> Outcome:
    """One attempt: how the server answered ``payload`` at ``path``."""
    started = time.perf_counter()
    try:
        if payload["stream"]:
            return await _streamed(client, path, payload, started)
        response = await client.post(path, json=payload)
    except httpx.HTTPError as error:
        return Outcome("transport", seconds=time.perf_counter() - started, detail=repr(error))
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        return _refused(response, seconds, response.text)
    body = response.json()
    return Outcome(
        "ok",
        status=200,
        seconds=seconds,
        completion_tokens=body["usage"]["completion_tokens"],
        tau=body.get("speculative", {}).get("tau"),
    )


async def _streamed(client: httpx.AsyncClient, path: str, payload: dict, started: float) -> Outcome:
    first_token = None
    final: dict | None = None
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return _refused(response, time.perf_counter() - started, text)
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return Outcome(
                    "stream_error",
                    status=200,
                    seconds=time.perf_counter() - started,
                    detail=str(chunk["error"].get("message")),
                )
            choice = (chunk.get("choices") or [{}])[0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece and first_token is None:
                first_token = time.perf_counter() - started
            if "usage" in chunk:
                final = chunk
    seconds = time.perf_counter() - started
    if not done or final is None:
        return Outcome("stream_error", status=200, seconds=seconds, detail="stream cut short")
    return Outcome(
        "ok",
        status=200,
        seconds=seconds,
        first_token_seconds=first_token,
        completion_tokens=final["usage"]["completion_tokens"],
        tau=final.get("speculative", {}).get("tau"),
    )


def _refused(response: httpx.Response, seconds: float, text: str) -> Outcome:
    status = response.status_code
    if status in (429, 503):
        kind = "busy_429" if status == 429 else "busy_503"
        return Outcome(
            kind, status=status, seconds=seconds, retry_after=_retry_after(response), refusals=1
        )
    kind = "server_error" if status >= 500 else "client_error"
    return Outcome(kind, status=status, seconds=seconds, detail=f"{status}: {text[:200]}")


def _retry_after(response: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (delay-seconds form), or None."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


async def run(args: argparse.Namespace) -> Report:
    """Send ``args.requests`` requests, ``args.concurrency`` at a time, within the time limit."""
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    report = Report()
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(
        base_url=args.url, timeout=timeout, limits=limits, headers=headers
    ) as client:

        async def worker(index: int) -> None:
            async with gate:
                outcome = await request_with_retries(
                    client,
                    path,
                    build_payload(args, index),
                    retries=args.retries,
                    max_retry_wait=args.max_retry_wait,
                )
                report.outcomes.append(outcome)

        started = time.perf_counter()
        tasks = [asyncio.create_task(worker(i)) for i in range(args.requests)]
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        report.unfinished = len(pending)
        report.wall_seconds = time.perf_counter() - started
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server (loopback only)")
    parser.add_argument("--requests", type=int, default=32, help="requests in all (default 32)")
    parser.add_argument("--concurrency", type=int, default=4, help="in flight at once (4)")
    parser.add_argument(
        "--time-limit", type=float, default=300.0, help="seconds for the whole run (300)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds for one request (600)"
    )
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--stream", action="store_true", help="stream (also reports TTFT)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, help="default: the server's (greedy)")
    parser.add_argument("--mode", choices=("target", "spd", "fly"))
    parser.add_argument("--drafter", choices=("model", "ngram", "mla"))
    parser.add_argument("-k", "--num-speculative-tokens", "--k", dest="k", type=int)
    parser.add_argument("--window", type=int)
    parser.add_argument("--theta", type=float)
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help="send a request refused with 429/503 again after its Retry-After, up to this many "
        "times (default 0: a refusal ends the request)",
    )
    parser.add_argument(
        "--max-retry-wait", type=float, default=30.0, help="longest wait before a retry (30 s)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("FLYSPEC_API_KEY"),
        help="sent as a Bearer token (default: $FLYSPEC_API_KEY)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    args = parser.parse_args(argv)
    if not is_loopback(args.url):
        parser.error(f"--url must be a loopback address (127.0.0.1, ::1, localhost): {args.url}")
    for name in ("requests", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if not args.time_limit > 0 or not args.request_timeout > 0:
        parser.error("--time-limit and --request-timeout must be > 0")
    if args.retries < 0 or not args.max_retry_wait >= 0:
        parser.error("--retries and --max-retry-wait must be >= 0")
    return args


def print_report(summary: dict, args: argparse.Namespace) -> None:
    counts = summary["counts"]
    latency = summary["latency_seconds"]
    print(
        f"{summary['requests']} requests to {args.url} ({args.endpoint}"
        f"{', stream' if args.stream else ''}), concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, retries {args.retries}"
    )
    print(
        f"  ended: 2xx {counts['2xx']}, 429 {counts['429']}, 503 {counts['503']}, "
        f"other 4xx {counts['other_4xx']}, other 5xx {counts['other_5xx']}, "
        f"transport errors {counts['transport_errors']}, stream errors "
        f"{counts['stream_errors']}, unfinished {counts['unfinished']}"
    )
    print(
        f"  {summary['attempts']} attempts, refusal rate {summary['refusal_rate']:.1%}"
        if summary["attempts"]
        else "  no attempt ended"
    )
    goodput = summary["goodput_requests_per_second"]
    print(
        f"  wall {summary['wall_seconds']:.2f}s: goodput {goodput:.2f} req/s, "
        f"{summary['goodput_tokens_per_second']:.1f} completion tok/s in all "
        f"({summary['completion_tokens']} tokens), mean tau {summary['mean_tau']}"
    )
    print(
        f"  latency (2xx): p50 {latency['p50']}s, p90 {latency['p90']}s, p99 {latency['p99']}s,"
        f" max {latency['max']}s"
    )
    if summary["first_token_seconds"]:
        ttft = summary["first_token_seconds"]
        print(f"  first token: p50 {ttft['p50']}s, p90 {ttft['p90']}s, p99 {ttft['p99']}s")
    for failure in summary["failures"]:
        print(f"  failure: {failure}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    summary = report.as_dict()
    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary, args)
    if report.failed or report.unfinished:
        print("load test FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
