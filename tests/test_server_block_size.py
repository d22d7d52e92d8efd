"""A request's ``k`` against the server's ``-k``: an integer, or ``"auto"``, and how each
meets a server started with a fixed K or with ``-k auto`` (docs/server.md)."""

import pytest
from pydantic import ValidationError

from flyspec.config import DecodeConfig
from flyspec.server.errors import describe_validation_errors
from flyspec.server.protocol import APIError, CompletionRequest
from flyspec.server.requests import request_config

FIXED = DecodeConfig(k=8)
AUTO = DecodeConfig(k=12, auto_k=True)


def block(defaults: DecodeConfig, **fields) -> tuple[int, bool]:
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    config = request_config(defaults, body, max_new_tokens=4)
    return config.k, config.auto_k


@pytest.mark.parametrize(
    ("defaults", "fields", "expected"),
    [
        (FIXED, {}, (8, False)),
        (FIXED, {"k": 3}, (3, False)),
        (FIXED, {"k": "auto"}, (8, True)),  # auto up to the server's K
        (AUTO, {}, (12, True)),
        (AUTO, {"k": 5}, (5, True)),  # the request's K is auto's ceiling
        (AUTO, {"k": "auto"}, (12, True)),
    ],
)
def test_a_requests_k_meets_the_servers(defaults, fields, expected):
    assert block(defaults, **fields) == expected


@pytest.mark.parametrize("value", ["fast", "AUTO", "4", ""])
def test_a_string_other_than_auto_is_refused_in_one_line(value):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "k": value})
    message, param, code = describe_validation_errors(caught.value.errors())
    assert param == "k" and code == "invalid_value"
    assert message == f'k must be an integer >= 1 or "auto", got {value!r}'


@pytest.mark.parametrize("defaults", [FIXED, AUTO], ids=["fixed", "auto"])
@pytest.mark.parametrize("value", [0, -3])
def test_a_k_below_one_is_refused_whatever_the_server(defaults, value):
    with pytest.raises(APIError) as caught:
        block(defaults, k=value)
    assert caught.value.status_code == 400 and caught.value.param == "k"
    assert f"k must be an integer >= 1, got {value}" in caught.value.message


@pytest.mark.parametrize(
    ("server_says", "stream", "expected"),
    [(True, True, True), (True, False, False), (False, True, False)],
)
def test_only_a_streamed_requests_first_token_comes_alone(server_says, stream, expected):
    body = CompletionRequest.model_validate({"prompt": "x", "stream": stream})
    defaults = FIXED.with_updates(first_token_alone=server_says)
    assert request_config(defaults, body, max_new_tokens=4).first_token_alone is expected
