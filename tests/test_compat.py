"""flash-attn compatibility: its argument names and positions, return_attn_probs, the
varlen packed functions, tensor windows and return_softmax_lse (issue 13, items 8, 11).

The deliberate differences are listed in docs/flash-attn-compat.md.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

import flashtile
from flashtile.interface import ATTN_PROBS_MAX_ELEMENTS
from flashtile.reference import attention_naive

# flash-attn 2's positional parameters (flash_attn/flash_attn_interface.py), in order.
# flash_attn_varlen_func ends with block_table after these; it is not in this list.
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", "dropout_p", "softmax_scale", "causal",
                        "window_size", "softcap", "alibi_slopes", "deterministic",
                        "return_attn_probs"],
    "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal",
                                  "window_size", "softcap", "alibi_slopes",
                                  "deterministic", "return_attn_probs"],
    "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal",
                                 "window_size", "softcap", "alibi_slopes",
                                 "deterministic", "return_attn_probs"],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                               "max_seqlen_q", "max_seqlen_k", "dropout_p",
                               "softmax_scale", "causal", "window_size", "softcap",
                               "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", "dropout_p",
                                         "softmax_scale", "causal", "window_size",
                                         "softcap", "alibi_slopes", "deterministic",
                                         "return_attn_probs"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                        "max_seqlen_q", "max_seqlen_k", "dropout_p",
                                        "softmax_scale", "causal", "window_size",
                                        "softcap", "alibi_slopes", "deterministic",
                                        "return_attn_probs"],
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos",
                                "rotary_sin", "cache_seqlens", "cache_batch_idx",
                                "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved",
                                "alibi_slopes", "num_splits", "return_softmax_lse"],
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_positional_parameters_match_flash_attn(name):
    """Code written for flash-attn passes arguments by position: the same order here.
    flashtile's return_lse is keyword only, after them."""
    params = inspect.signature(getattr(flashtile, name)).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional[:len(FLASH_ATTN_SIGNATURES[name])] == FLASH_ATTN_SIGNATURES[name]
    assert "return_lse" in [p.name for p in params if p.kind == p.KEYWORD_ONLY]


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _probs_oracle(q, k, **kw):
    """Float64 probabilities (b, h, sq, sk) from the oracle: attention over one-hot values
    (v[j] = e_j) returns row i's probabilities as its output."""
    b, sk, hkv, _ = k.shape
    eye = torch.eye(sk, dtype=torch.float64, device=q.device)[None, :, None, :]
    eye = eye.expand(b, sk, hkv, sk)
    out, lse = attention_naive(q.double(), k.double(), eye, **kw)
    return out.permute(0, 2, 1, 3), lse


PROB_CASES = {
    "causal_gqa": (5, 7, dict(causal=True)),
    "rows_without_keys": (7, 3, dict(causal=True)),
    "window_softcap_alibi": (6, 9, dict(window_size=(2, 1), softcap=3.0, alibi="bh")),
    "no_key": (4, 0, dict()),
}


@pytest.mark.parametrize("case", list(PROB_CASES))
def test_return_attn_probs_dense(case, backend, device):
    """(out, lse, probs): out and lse as with return_lse, probs the oracle's in float32."""
    sq, sk, kw = PROB_CASES[case]
    kw = dict(kw)
    b, h, hkv, d = 2, 4, 2, 16
    q = torch.randn(b, sq, h, d, device=device, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device=device) for _ in "kv")
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(b, h, device=device)
    out, lse, probs = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    out_ref, lse_ref = flashtile.flash_attn_func(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close((out, lse), (out_ref, lse_ref), rtol=0, atol=0)
    assert probs.shape == (b, h, sq, sk) and probs.dtype == torch.float32
    assert not probs.requires_grad and out.requires_grad
    want, _ = _probs_oracle(q.detach(), k, **kw)
    torch.testing.assert_close(probs, want.float(), rtol=1e-6, atol=1e-7)


def test_return_attn_probs_varlen(backend, device):
    """Sequence b's probabilities sit in the top-left corner of probs[b] (the dense call's
    on that sequence), zeros around them; an empty sequence is all zeros."""
    lens_q, lens_k = [3, 0, 5, 2], [4, 2, 6, 0]
    h, hkv, d = 4, 2, 16
    q = torch.randn(sum(lens_q), h, d, device=device)
    k, v = (torch.randn(sum(lens_k), hkv, d, device=device) for _ in "kv")
    alibi = torch.rand(len(lens_q), h, device=device)
    cu_q, cu_k = _cu(lens_q).to(device), _cu(lens_k).to(device)
    out, lse, probs = flashtile.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 6, 7, causal=True, alibi_slopes=alibi, return_attn_probs=True)
    assert probs.shape == (len(lens_q), h, 6, 7)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = int(cu_q[i]), int(cu_k[i])
        _, _, want = flashtile.flash_attn_func(
            q[None, qs:qs + lq], k[None, ks:ks + lk], v[None, ks:ks + lk], causal=True,
            alibi_slopes=alibi[i:i + 1], return_attn_probs=True)
        torch.testing.assert_close(probs[i, :, :lq, :lk], want[0], rtol=0, atol=0)
        assert not probs[i, :, lq:].any() and not probs[i, :, :, lk:].any()


def test_return_attn_probs_size_limit():
    """Dense probabilities are a test aid: past ATTN_PROBS_MAX_ELEMENTS a ValueError names
    the argument and the limit. Meta tensors: nothing is allocated."""
    n = 4096  # 1 * 1 * 4096 * 4096 == 2**24, the limit itself, is allowed
    assert n * n == ATTN_PROBS_MAX_ELEMENTS
    q = torch.empty(1, n, 1, 8, device="meta")
    assert flashtile.flash_attn_func(q, q, q, return_attn_probs=True)[2].shape == (1, 1, n, n)
    k = torch.empty(1, n + 1, 1, 8, device="meta")
    with pytest.raises(ValueError, match=r"return_attn_probs: expected batch \* nheads \* "
                       r"seqlen_q \* seqlen_k <= ATTN_PROBS_MAX_ELEMENTS = 16777216 .*, "
                       r"got 1 \* 1 \* 4096 \* 4097 = 16781312"):
        flashtile.flash_attn_func(q, k, k, return_attn_probs=True)
    # Varlen probabilities are (batch, nheads, max_seqlen_q, max_seqlen_k).
    qp = torch.randn(3, 1, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"got 1 \* 1 \* 4096 \* 4097 = 16781312"):
        flashtile.flash_attn_varlen_func(qp, qp, qp, cu, cu, n, n + 1,
                                         return_attn_probs=True)


def test_packed_functions_equal_unpacked(backend, device):
    """The four packed forms are views of the unpacked call: same outputs and gradients
    (the packed gradient is the unpacked ones stacked)."""
    lens = [3, 6]
    total, h, d = sum(lens), 4, 16
    cu = _cu(lens).to(device)
    qkv = torch.randn(1, total, 3, h, d, device=device, requires_grad=True)
    q, k, v = qkv.unbind(2)
    kw = dict(causal=True, window_size=(2, 0))
    want = flashtile.flash_attn_func(q, k, v, **kw)
    got = {
        "qkvpacked": flashtile.flash_attn_qkvpacked_func(qkv, **kw),
        "kvpacked": flashtile.flash_attn_kvpacked_func(q, qkv[:, :, 1:], **kw),
    }
    varlen_want = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 6, 6, **kw)
    varlen_got = {
        "varlen_qkvpacked": flashtile.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 6, **kw),
        "varlen_kvpacked": flashtile.flash_attn_varlen_kvpacked_func(
            q[0], qkv[0, :, 1:], cu, cu, 6, 6, **kw),
    }
    for name, out in itertools.chain(got.items(), varlen_got.items()):
        ref = want if out.dim() == 4 else varlen_want
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=name)
        (grad,) = torch.autograd.grad(out.square().sum(), qkv)
        (grad_ref,) = torch.autograd.grad(ref.square().sum(), qkv, retain_graph=True)
        torch.testing.assert_close(grad, grad_ref, rtol=0, atol=0, msg=name)
    out, lse, probs = flashtile.flash_attn_varlen_qkvpacked_func(
        qkv[0], cu, 6, return_attn_probs=True)
    assert probs.shape == (2, h, 6, 6) and lse.shape == (h, total)


def test_varlen_packed_rejects():
    cu = _cu([2, 3])
    with pytest.raises(ValueError, match=r"qkv.shape: expected a 4-d tensor with size 3 "
                       r"at dim 1, got \(5, 2, 4, 16\)"):
        flashtile.flash_attn_varlen_qkvpacked_func(torch.randn(5, 2, 4, 16), cu, 3)
    with pytest.raises(ValueError, match=r"kv: expected a 4-d tensor, got shape "
                       r"\(5, 2, 16\)"):
        flashtile.flash_attn_varlen_kvpacked_func(torch.randn(5, 4, 16),
                                                  torch.randn(5, 2, 16), cu, cu, 3, 3)


@pytest.mark.parametrize("window", [
    torch.tensor([3, 1]), torch.tensor([3, 1], dtype=torch.int32),
    (torch.tensor(3), torch.tensor(1)), [3, 1]], ids=["int64", "int32", "0d-pair", "list"])
def test_window_size_as_tensor(window, backend, device):
    """flash-attn's tests draw windows with torch.randint: a 2-element integer tensor (or
    a pair of 0-d ones) means the same as the tuple of its values."""
    q, k, v = (torch.randn(1, 9, 2, 16, device=device) for _ in "qkv")
    want = flashtile.flash_attn_func(q, k, v, window_size=(3, 1))
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, window_size=window), want,
                               rtol=0, atol=0)
    k_cache, v_cache = k.clone(), v.clone()
    got = flashtile.flash_attn_with_kvcache(q[:, -2:], k_cache, v_cache, cache_seqlens=9,
                                            window_size=window)
    torch.testing.assert_close(got, flashtile.flash_attn_with_kvcache(
        q[:, -2:], k_cache, v_cache, cache_seqlens=9, window_size=(3, 1)), rtol=0, atol=0)


WINDOW_TYPES = "a pair of ints (left, right), or a 2-element integer tensor"


@pytest.mark.parametrize("window, error, message", [
    (torch.tensor([3.0, 1.0]), TypeError, f"window_size: expected {WINDOW_TYPES}"),
    (torch.tensor([3, 1, 0]), TypeError, f"window_size: expected {WINDOW_TYPES}"),
    (torch.tensor([[3, 1]]), TypeError, f"window_size: expected {WINDOW_TYPES}"),
    (torch.tensor([True, False]), TypeError, f"window_size: expected {WINDOW_TYPES}"),
    ((torch.tensor([3]), 1), TypeError, f"window_size: expected {WINDOW_TYPES}"),
    (torch.tensor([-2, 0]), ValueError,
     "window_size: expected each bound >= 0, or -1 for unbounded, got (-2, 0)"),
], ids=["float", "3-elements", "2-d", "bool", "1-d-element", "minus-2"])
def test_window_size_tensor_rejects(window, error, message):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        flashtile.flash_attn_func(q, q, q, window_size=window)


def test_kvcache_return_softmax_lse(device):
    """flash-attn's name returns (out, lse); flashtile's return_lse is the same flag."""
    q = torch.randn(2, 1, 4, 16, device=device)
    k_cache, v_cache = (torch.randn(2, 12, 2, 16, device=device) for _ in "kv")
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5,
                                                 return_softmax_lse=True)
    out2, lse2 = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5,
                                                   return_lse=True)
    torch.testing.assert_close((out, lse), (out2, lse2), rtol=0, atol=0)
    assert lse.shape == (2, 4, 1)
