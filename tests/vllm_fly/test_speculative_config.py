"""The fields of vLLM 0.34's SpeculativeConfig that flyspec's detection of built-in FLy reads."""

import dataclasses
import typing

import pytest
from vllm.config import SpeculativeConfig


def ngram_config(**fly) -> SpeculativeConfig:
    """A speculative config that needs no model (prompt lookup)."""
    return SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, **fly
    )


def test_fly_fields_exist():
    names = {field.name for field in dataclasses.fields(SpeculativeConfig)}
    assert {"fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k"} <= names
    annotation = typing.get_type_hints(SpeculativeConfig)["rejection_sample_method"]
    assert "fly" in typing.get_args(annotation)


def test_fly_config_without_a_model():
    config = ngram_config(rejection_sample_method="fly", fly_entropy_threshold=0.5)
    assert config.rejection_sample_method == "fly"
    assert config.fly_window_size == 3  # unset: min(6, num_speculative_tokens - 1)
    assert config.fly_entropy_threshold == 0.5
    assert config.fly_entropy_top_k == 3


def test_fly_window_must_fit_in_the_block():
    with pytest.raises(ValueError, match="fly_window_size"):
        ngram_config(rejection_sample_method="fly", fly_window_size=4)


def test_fly_off_by_default():
    config = ngram_config()
    assert config.rejection_sample_method == "standard"
    assert config.fly_window_size is None
