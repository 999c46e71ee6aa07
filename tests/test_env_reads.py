"""The environment variables flashtile reads on every call are read live (issue 15's
host-time work reads them through ``_backend.getenv``, not ``os.environ.get``): a
change after the first call takes effect at the next one."""

import os

import pytest
import torch

import flashtile
from flashtile import _backend


@pytest.mark.parametrize("value", ["triton", " Torch ", "", "é-ünïcode"])
def test_getenv_matches_os_environ(monkeypatch, value):
    assert _backend.getenv("FLASHTILE_TEST_ENV", "unset") == "unset"
    monkeypatch.setenv("FLASHTILE_TEST_ENV", value)
    assert _backend.getenv("FLASHTILE_TEST_ENV", "unset") == os.environ["FLASHTILE_TEST_ENV"]
    monkeypatch.delenv("FLASHTILE_TEST_ENV")
    assert _backend.getenv("FLASHTILE_TEST_ENV", "unset") == "unset"


def test_backend_variable_changed_after_a_call_takes_effect(monkeypatch):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    flashtile.flash_attn_func(q, k, v, causal=True)
    monkeypatch.setenv("FLASHTILE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FLASHTILE_BACKEND must be one of"):
        flashtile.flash_attn_func(q, k, v, causal=True)
    monkeypatch.delenv("FLASHTILE_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _backend.select_backend(q.device) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.select_backend(q.device) == "triton"


def test_hopper_mode_changed_after_a_call_takes_effect(monkeypatch):
    monkeypatch.delenv("FLASHTILE_HOPPER_FWD", raising=False)
    assert _backend.hopper_fwd_mode() == "auto"
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", " 0 ")
    assert _backend.hopper_fwd_mode() == "0"
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_HOPPER_FWD must be"):
        _backend.hopper_fwd_mode()
