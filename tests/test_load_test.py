"""benchmarks/load_test.py: retries that honour Retry-After, refusal rate and goodput."""

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"
_SPEC = importlib.util.spec_from_file_location("load_test", _PATH)
load_test = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = load_test  # dataclasses look their module up while it runs
_SPEC.loader.exec_module(load_test)

COMPLETION = {"usage": {"completion_tokens": 5}, "speculative": {"tau": 2.5}}


def busy_then_ok(refusals: int, retry_after: str | None):
    """A server that refuses the first ``refusals`` requests with 429, then completes."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if len(seen) <= refusals:
            headers = {} if retry_after is None else {"Retry-After": retry_after}
            return httpx.Response(429, headers=headers, json={"error": {"message": "busy"}})
        return httpx.Response(200, json=COMPLETION)

    return handler, seen


def send(handler, *, retries, monkeypatch, max_retry_wait=30.0):
    waits = []

    async def no_sleep(seconds):
        waits.append(seconds)

    monkeypatch.setattr(load_test.asyncio, "sleep", no_sleep)

    async def go():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await load_test.request_with_retries(
                client,
                "/v1/completions",
                {"prompt": "x", "stream": False},
                retries=retries,
                max_retry_wait=max_retry_wait,
            )

    return asyncio.run(go()), waits


def test_refused_requests_are_sent_again_after_their_retry_after(monkeypatch):
    handler, seen = busy_then_ok(2, "3")
    outcome, waits = send(handler, retries=5, monkeypatch=monkeypatch)
    assert outcome.kind == "ok" and outcome.completion_tokens == 5
    assert (outcome.attempts, outcome.refusals) == (3, 2)
    assert waits == [3.0, 3.0] and len(seen) == 3


def test_retries_are_bounded_and_waits_capped(monkeypatch):
    handler, seen = busy_then_ok(10, "120")
    outcome, waits = send(handler, retries=2, monkeypatch=monkeypatch, max_retry_wait=4.0)
    assert outcome.kind == "busy_429" and outcome.retry_after == 120.0
    assert (outcome.attempts, outcome.refusals) == (3, 3)
    assert waits == [4.0, 4.0]


def test_a_refusal_without_retry_after_waits_one_second(monkeypatch):
    outcome, waits = send(busy_then_ok(1, None)[0], retries=1, monkeypatch=monkeypatch)
    assert outcome.kind == "ok" and waits == [1.0]


def test_no_retries_keeps_the_first_answer(monkeypatch):
    outcome, waits = send(busy_then_ok(1, "0")[0], retries=0, monkeypatch=monkeypatch)
    assert outcome.kind == "busy_429" and outcome.attempts == 1 and waits == []


def test_report_gives_refusal_rate_and_goodput():
    report = load_test.Report(
        outcomes=[
            load_test.Outcome("ok", status=200, completion_tokens=10, attempts=3, refusals=2),
            load_test.Outcome("ok", status=200, completion_tokens=6),
            load_test.Outcome("busy_503", status=503, attempts=2, refusals=2),
        ],
        wall_seconds=2.0,
    )
    summary = report.as_dict()
    assert summary["attempts"] == 6 and summary["refusal_rate"] == pytest.approx(4 / 6, abs=1e-4)
    assert summary["goodput_requests_per_second"] == 1.0
    assert summary["goodput_tokens_per_second"] == 8.0
    assert not report.failed
    json.dumps(summary)


def test_api_key_is_sent_as_a_bearer_token(monkeypatch):
    handler, seen = busy_then_ok(0, None)
    args = load_test.parse_args(["--requests", "1", "--api-key", "sk-test"])

    async def go():
        transport = httpx.MockTransport(handler)
        original = httpx.AsyncClient

        def client(**kwargs):
            return original(transport=transport, **kwargs)

        monkeypatch.setattr(load_test.httpx, "AsyncClient", client)
        return await load_test.run(args)

    report = asyncio.run(go())
    assert [o.kind for o in report.outcomes] == ["ok"] and seen == ["Bearer sk-test"]
