"""Configuration errors name the setting they are about (the server answers with it as the
request's ``param``)."""

import math

import pytest

from flyspec.config import ConfigError, DecodeConfig, FlyConfig, KernelConfig, SamplingConfig

BAD_VALUES = [
    (FlyConfig, "window", -1),
    (FlyConfig, "theta", math.nan),
    (FlyConfig, "entropy", "full"),
    (FlyConfig, "min_ratio", 2.0),
    (FlyConfig, "max_rank", -1),
    (FlyConfig, "defer", "yes"),
    (SamplingConfig, "temperature", -1.0),
    (SamplingConfig, "top_k", -1),
    (SamplingConfig, "top_p", 0.0),
    (SamplingConfig, "seed", -5),
    (DecodeConfig, "mode", "fast"),
    (DecodeConfig, "drafter", "oracle"),
    (DecodeConfig, "k", 0),
    (DecodeConfig, "max_new_tokens", 0),
    (DecodeConfig, "draft_temperature", -0.5),
    (DecodeConfig, "draft_confidence", 1.0),
    (DecodeConfig, "max_ngram", 0),
    (DecodeConfig, "mla_proposals", 0),
    (DecodeConfig, "stop", ("",)),
    (KernelConfig, "linear", "mkl"),
    (KernelConfig, "draft_quant", "int4"),
    (KernelConfig, "target_quant", "int2"),
    (KernelConfig, "forward", "fast"),
]


@pytest.mark.parametrize("kind, field, value", BAD_VALUES)
def test_a_bad_value_is_refused_naming_its_field(kind, field, value):
    with pytest.raises(ConfigError) as caught:
        kind(**{field: value})
    assert caught.value.field == field
    assert str(caught.value).startswith(field)


def test_a_conflict_names_the_setting_it_refuses():
    with pytest.raises(ConfigError, match="the mla drafter drafts greedily") as caught:
        DecodeConfig(drafter="mla", draft_temperature=0.7)
    assert caught.value.field == "drafter"


def test_the_defaults_are_valid():
    config = DecodeConfig()
    assert (config.mode, config.k, config.fly.window, config.fly.theta) == ("fly", 15, 6, 0.3)
    assert KernelConfig() == KernelConfig("onednn", "int8", "none", "auto")
    assert KernelConfig.plain() == KernelConfig("default", "none", "none", "transformers")


def test_another_librarys_error_is_told_in_one_line():
    from flyspec.errors import error_line

    assert error_line(RuntimeError("first\nsecond")) == "RuntimeError: first"
    assert error_line(ValueError("abcdef"), limit=3) == "ValueError: abc"
    assert error_line(KeyError()) == "KeyError"
