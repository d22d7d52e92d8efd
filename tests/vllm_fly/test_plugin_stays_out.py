"""flyspec's plugin on a vLLM with FLy built in: it stays out of the verification, and a
``flyspec`` section stops the start-up with the native keys to use instead."""

import pytest

from flyspec.integrations.vllm.launch import native_fly_version
from flyspec.integrations.vllm.plugin import register
from flyspec.integrations.vllm.sampler import refusing_sampler_class
from flyspec.integrations.vllm.settings import VllmPluginError


class Sampler:
    def __init__(self, *args, **kwargs):
        self.built = True


def test_fly_built_in_is_detected():
    assert native_fly_version() == "0.34.0"


def test_register_does_not_fail_where_fly_is_built_in(monkeypatch):
    """Without a V1 runner the plugin has no seam; with FLy built in that is no error, even
    where FLYSPEC_VLLM asks for FLy (the V2 sampler then names the native keys)."""
    monkeypatch.setenv("FLYSPEC_VLLM", "{}")
    register()


def test_a_flyspec_section_stops_the_start_up_with_the_native_keys(monkeypatch):
    monkeypatch.setenv("FLYSPEC_VLLM", '{"fly_window_size": 4, "fly_entropy_threshold": 0.5}')
    with pytest.raises(VllmPluginError) as raised:
        refusing_sampler_class(Sampler)(None, None, "cpu")
    message = str(raised.value)
    assert "vLLM 0.34.0 has FLy built in" in message and "\n" not in message
    assert '"fly_window_size": 4, "fly_entropy_threshold": 0.5' in message


def test_without_a_section_the_sampler_is_vllms(monkeypatch):
    monkeypatch.delenv("FLYSPEC_VLLM", raising=False)
    assert refusing_sampler_class(Sampler)(None, None, "cpu").built
