"""A request's decoding settings: the server's defaults with the fields the request sets."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from flyspec.config import ConfigError, DecodeConfig, FlyConfig, SamplingConfig
from flyspec.server.protocol import (
    MESSAGE_LIMIT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    clip,
)

# The FLy rule's settings a request can set: every field of FlyConfig.
_RULE_FIELDS = tuple(field.name for field in dataclasses.fields(FlyConfig))

# The settings a request can set, by DecodeConfig's name -> the request field's name.
_CONFIG_PARAMS = {
    **{
        name: name
        for name in (
            "mode",
            "drafter",
            "k",
            *_RULE_FIELDS,
            "temperature",
            "top_k",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "stop",
            "loosen_predicted",
        )
    },
    "max_new_tokens": "max_tokens",
}


def request_config(
    defaults: DecodeConfig,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_new_tokens: int,
) -> DecodeConfig:
    """The server defaults with the request's overrides, validated (APIError 400 if not).

    A request's first token comes alone (``first_token_alone``) where the server's defaults
    say so and the request is streamed.

    The server's K is a ceiling where either side asks for ``-k auto``: a request's ``k:
    "auto"`` chooses every round up to the server's K, and a request's integer ``k`` on a
    server started with ``-k auto`` is the ceiling of the server's choice."""

    def pick(value, default):
        return default if value is None else value

    try:
        fly = defaults.fly
        overrides = {name: getattr(body, name) for name in _RULE_FIELDS}
        if any(value is not None for value in overrides.values()):
            fly = replace(fly, **{k: v for k, v in overrides.items() if v is not None})
        sampling = defaults.sampling
        try:
            bias = body.bias_pairs if body.logit_bias is not None else sampling.logit_bias
        except ValueError as error:
            raise ConfigError(str(error), field="logit_bias") from None
        sampling = SamplingConfig(
            temperature=pick(body.temperature, sampling.temperature),
            top_k=pick(body.top_k, sampling.top_k),
            top_p=pick(body.top_p, sampling.top_p),
            seed=pick(body.seed, sampling.seed),
            presence_penalty=pick(body.presence_penalty, sampling.presence_penalty),
            frequency_penalty=pick(body.frequency_penalty, sampling.frequency_penalty),
            repetition_penalty=pick(body.repetition_penalty, sampling.repetition_penalty),
            logit_bias=bias,
        )
        stop = body.stop_strings
        k, auto_k = block_size(defaults, body.k)
        return replace(
            defaults,
            mode=pick(body.mode, defaults.mode),
            drafter=pick(body.drafter, defaults.drafter),
            k=k,
            auto_k=auto_k,
            loosen_predicted=pick(body.loosen_predicted, defaults.loosen_predicted),
            max_new_tokens=max_new_tokens,
            fly=fly,
            sampling=sampling,
            stop=defaults.stop if stop is None else stop,
            first_token_alone=defaults.first_token_alone and body.stream,
        )
    except ConfigError as error:
        message = str(error)
        param = _CONFIG_PARAMS.get(error.field)
        raise APIError(
            400, clip(message, MESSAGE_LIMIT), param=param, code="invalid_value"
        ) from None


def block_size(defaults: DecodeConfig, k: int | str | None) -> tuple[int, bool]:
    """``(k, auto_k)`` for a request's ``k`` field (None: the server's): ``"auto"`` is auto
    up to the server's K; an integer is the fixed K, or auto's ceiling on a server started
    with ``-k auto``."""
    if k is None:
        return defaults.k, defaults.auto_k
    if k == "auto":
        return defaults.k, True
    return k, defaults.auto_k
