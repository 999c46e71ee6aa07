"""The shortcuts of the eager host path (issue 15) keep every check: the environment
variables read on every call are read live (``_backend.getenv``, not
``os.environ.get``), so a change after the first call takes effect at the next one;
the options that pass at a glance skip the checks' calls, and every other value still
meets them, after a good call too."""

import os

import pytest
import torch

import flashtile
from flashtile import _backend, interface
from flashtile import _validate as V


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


@pytest.mark.parametrize("kw, error, message", [
    (dict(causal=1), TypeError, "causal: expected a bool"),
    (dict(causal="False"), TypeError, "causal: expected a bool"),
    (dict(dropout_p=float("nan")), ValueError, "dropout_p"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(dropout_p=1), ValueError, "dropout_p"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p: expected a float"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(deterministic=0), TypeError, "deterministic: expected a bool"),
], ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_options_after_a_good_call_still_raise(kw, error, message):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, causal=True, dropout_p=0.0, softmax_scale=0.5,
                              softcap=0.0)
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(q, k, v, **{"causal": True, **kw})


def _full_checks(monkeypatch, name, memo):
    """(max_seqlen_q, max_seqlen_k) of every call of _validate's check ``name`` from now
    on, the memo's layouts forgotten first; the PyTorch backend (no kernel to wait for)."""
    calls = []
    check = getattr(V, name)
    monkeypatch.setattr(V, name, lambda *args, **kw: calls.append(args[5:7]) or check(*args, **kw))
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    memo.cache_clear()
    return calls


def test_varlen_checks_each_layout_once(monkeypatch):
    """Regression (issue 15): flash_attn_varlen_func ran check_varlen in full on every
    call, about a third of its eager host path on the CPU. Now a layout of q, k, v and
    the cu_seqlens is checked at its first call; another layout (a token count, a
    strided cu_seqlens), and any max_seqlen that is not an int in range, is checked in
    full again."""
    checks = _full_checks(monkeypatch, "check_varlen", interface._check_varlen_layouts)
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    for max_seqlen in (7, 7, 9, 2**20):  # the values are no part of the layouts
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen)
    assert len(checks) == 1
    flashtile.flash_attn_varlen_func(q[:5], k[:5], v[:5], cu[:2], cu[:2], 5, 5)
    strided = torch.stack([cu, cu], dim=1)[:, 0]
    flashtile.flash_attn_varlen_func(q, k, v, strided, cu, 7, 7)
    flashtile.flash_attn_varlen_func(q, k, v, strided, cu, 7, 7)
    assert len(checks) == 3
    with pytest.raises(ValueError, match="max_seqlen_k: expected an int from 0"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 7, -1)
    assert checks[-1] == (7, -1)


def test_paged_varlen_checks_each_layout_once(monkeypatch):
    """As the packed form: an engine's prefill over a paged pool (prefix-cache hits,
    prompt chunks) checks each layout of q, the pool, the block table and the index
    tensors once; max_seqlen_k against the block table's reach is checked every call."""
    checks = _full_checks(monkeypatch, "check_paged_varlen",
                          interface._check_paged_varlen_layouts)
    q = torch.randn(9, 2, 16)
    pool = torch.randn(8, 16, 2, 16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)  # 64 keys a sequence
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    seqused_k = torch.tensor([20, 33], dtype=torch.int32)
    with torch.no_grad():
        for max_seqlen_k in (33, 33, 64):
            flashtile.flash_attn_varlen_func(q, pool, pool, cu_q, None, 5, max_seqlen_k,
                                             block_table=table, seqused_k=seqused_k)
        assert len(checks) == 1
        with pytest.raises(ValueError, match="max_seqlen_k: expected at most block_table"):
            flashtile.flash_attn_varlen_func(q, pool, pool, cu_q, None, 5, 65,
                                             block_table=table, seqused_k=seqused_k)
    assert checks[-1] == (5, 65)
