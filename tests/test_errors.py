"""Bad input raises a clear error before any kernel launch; valid edge input just works.

The first half feeds each public function one mistake at a time and checks the error
type and that the message names the argument and the value given (style rule 6). The
second half runs valid but degenerate shapes (one query, one key, no key, no batch, rows
that see no key) on both backends and checks them against the float64 oracle with the
project's accuracy rule: error <= 2 x PyTorch's own fp32 error + 1e-5.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive

# Small, odd shapes: (batch, seqlen, nheads, head_dim) = (1, 8, 4, 16) for q and
# nheads_kv = 2 for k/v, so GQA is on in every flash_attn_func case.
B, S, H, HKV, D = 1, 8, 4, 2, 16


def _qkv(b=B, sq=S, sk=S, h=H, hkv=HKV, d=D, dtype=torch.float32):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))


def _last_dim_strided(*shape):
    """A view of ``shape`` whose last dim has stride != 1 (dims 1 and 3 swapped)."""
    b, s, h, d = shape
    x = torch.randn(b, d, h, s).transpose(1, 3)
    assert x.shape == shape and x.stride(-1) != 1
    return x


WINDOW_TYPES = "a pair of ints (left, right), or a 2-element integer tensor"

# Each case: (change to the valid arguments, error type, literal message fragment).
# The fragment always holds the argument's name and the value that was given.
FLASH_CASES = [
    pytest.param(lambda q, k, v: dict(k=k.half()), TypeError,
                 "k.dtype: expected q's dtype torch.float32, got torch.float16",
                 id="dtype-mismatch-k"),
    pytest.param(lambda q, k, v: dict(v=v.bfloat16()), TypeError,
                 "v.dtype: expected q's dtype torch.float32, got torch.bfloat16",
                 id="dtype-mismatch-v"),
    pytest.param(lambda q, k, v: dict(k=k.to("meta")), ValueError,
                 "k.device: expected q's device cpu, got meta", id="device-mismatch-k"),
    pytest.param(lambda q, k, v: dict(v=v.to("meta")), ValueError,
                 "v.device: expected q's device cpu, got meta", id="device-mismatch-v"),
    pytest.param(lambda q, k, v: dict(q=q[0]), ValueError,
                 f"q: expected a 4-d tensor, got shape {(S, H, D)}", id="rank-3-q"),
    pytest.param(lambda q, k, v: dict(k=k[None]), ValueError,
                 f"k: expected a 4-d tensor, got shape {(1, B, S, HKV, D)}", id="rank-5-k"),
    pytest.param(lambda q, k, v: dict(k=k[..., :8].contiguous(), v=v[..., :8].contiguous()),
                 ValueError, "k.shape[-1] (head_dim): expected q's head_dim 16, got 8",
                 id="head_dim-mismatch"),
    pytest.param(lambda q, k, v: dict(zip("qkv", _qkv(d=513))), ValueError,
                 "q.shape[-1] (head_dim): expected 1 to 512, got 513", id="head_dim-513"),
    pytest.param(lambda q, k, v: dict(q=torch.randn(B, S, 3, D)), ValueError,
                 "k.shape[2] (nheads_kv): expected a divisor of q's nheads 3 (GQA/MQA), "
                 "got 2",
                 id="nheads-3-over-kv-2"),
    pytest.param(lambda q, k, v: dict(zip("qkv", (x.int() for x in (q, k, v)))), TypeError,
                 "q: expected dtype float16, bfloat16, float32, "
                 "float8_e4m3fn or float8_e5m2, got torch.int32",
                 id="int32"),
    pytest.param(lambda q, k, v: dict(k=k.long()), TypeError,
                 "k: expected dtype float16, bfloat16, float32, "
                 "float8_e4m3fn or float8_e5m2, got torch.int64",
                 id="int64-k"),
    pytest.param(lambda q, k, v: dict(zip("qkv", (x.double() for x in (q, k, v)))),
                 TypeError,
                 "q: expected dtype float16, bfloat16, float32, "
                 "float8_e4m3fn or float8_e5m2, got torch.float64",
                 id="float64"),
    pytest.param(lambda q, k, v: dict(q=q.tolist()), TypeError,
                 "q: expected a torch.Tensor, got list", id="non-tensor-q"),
    pytest.param(lambda q, k, v: dict(v=None), TypeError,
                 "v: expected a torch.Tensor, got NoneType", id="none-v"),
    pytest.param(lambda q, k, v: dict(k=torch.randn(2, S, HKV, D),
                                      v=torch.randn(2, S, HKV, D)),
                 ValueError, "k.shape[0] (batch): expected q's batch 1, got 2",
                 id="batch-mismatch"),
    pytest.param(lambda q, k, v: dict(v=torch.randn(B, S + 1, HKV, D)), ValueError,
                 f"v.shape[:-1]: expected k's {(B, S, HKV)}, got {(B, S + 1, HKV)}",
                 id="k-v-seqlen-mismatch"),
    pytest.param(lambda q, k, v: dict(q=_last_dim_strided(B, S, H, D)), ValueError,
                 "q.stride(-1): expected 1 (the head dim contiguous), got 32",
                 id="q-last-dim-strided"),
    pytest.param(lambda q, k, v: dict(v=_last_dim_strided(B, S, HKV, D)), ValueError,
                 "v.stride(-1): expected 1 (the head dim contiguous), got 16",
                 id="v-last-dim-strided"),
    pytest.param(lambda q, k, v: dict(window_size=(-2, 0)), ValueError,
                 "window_size: expected each bound >= 0, or -1 for unbounded, got (-2, 0)",
                 id="window-minus-2"),
    pytest.param(lambda q, k, v: dict(window_size=(1, 2, 3)), TypeError,
                 f"window_size: expected {WINDOW_TYPES}, got (1, 2, 3)",
                 id="window-3-tuple"),
    pytest.param(lambda q, k, v: dict(window_size=(4.0, 0.0)), TypeError,
                 f"window_size: expected {WINDOW_TYPES}, got (4.0, 0.0)",
                 id="window-floats"),
    pytest.param(lambda q, k, v: dict(window_size=4), TypeError,
                 f"window_size: expected {WINDOW_TYPES}, got 4",
                 id="window-int"),
    pytest.param(lambda q, k, v: dict(window_size=(True, False)), TypeError,
                 f"window_size: expected {WINDOW_TYPES}, got (True, False)",
                 id="window-bools"),
    pytest.param(lambda q, k, v: dict(alibi_slopes=torch.rand(3)), ValueError,
                 f"alibi_slopes.shape: expected ({H},) or ({B}, {H}), got (3,)",
                 id="alibi-shape-nheads"),
    pytest.param(lambda q, k, v: dict(alibi_slopes=torch.rand(2, H)), ValueError,
                 f"alibi_slopes.shape: expected ({H},) or ({B}, {H}), got (2, {H})",
                 id="alibi-shape-batch"),
    pytest.param(lambda q, k, v: dict(alibi_slopes=torch.rand(H, device="meta")),
                 ValueError, "alibi_slopes.device: expected q's device cpu, got meta",
                 id="alibi-device"),
    pytest.param(lambda q, k, v: dict(alibi_slopes=torch.ones(H, dtype=torch.int32)),
                 TypeError, "alibi_slopes.dtype: expected a floating dtype (float32), got "
                 "torch.int32", id="alibi-int"),
    pytest.param(lambda q, k, v: dict(alibi_slopes=[0.5] * H), TypeError,
                 "alibi_slopes: expected a torch.Tensor or None, got list",
                 id="alibi-list"),
    pytest.param(lambda q, k, v: dict(softcap=-1.0), ValueError,
                 "softcap: expected a finite float >= 0.0, got -1.0",
                 id="softcap-negative"),
    pytest.param(lambda q, k, v: dict(softcap=float("nan")), ValueError,
                 "softcap: expected a finite float >= 0.0, got nan", id="softcap-nan"),
    pytest.param(lambda q, k, v: dict(softmax_scale=float("nan")), ValueError,
                 "softmax_scale: expected a finite float, got nan", id="scale-nan"),
    pytest.param(lambda q, k, v: dict(softmax_scale=float("inf")), ValueError,
                 "softmax_scale: expected a finite float, got inf", id="scale-inf"),
    pytest.param(lambda q, k, v: dict(softmax_scale=-float("inf")), ValueError,
                 "softmax_scale: expected a finite float, got -inf", id="scale-minus-inf"),
    pytest.param(lambda q, k, v: dict(softmax_scale="0.25"), TypeError,
                 "softmax_scale: expected a float, got str", id="scale-str"),
    pytest.param(lambda q, k, v: dict(dropout_p=1.5), ValueError,
                 "dropout_p: expected a probability in [0, 1), got 1.5", id="dropout-1.5"),
    pytest.param(lambda q, k, v: dict(dropout_p=1.0), ValueError,
                 "dropout_p: expected a probability in [0, 1), got 1.0", id="dropout-1.0"),
    pytest.param(lambda q, k, v: dict(dropout_p=-0.1), ValueError,
                 "dropout_p: expected a finite float >= 0.0, got -0.1",
                 id="dropout-negative"),
]


def _assert_rejects(fn, names, qkv, change, error, message):
    """fn(**{names: qkv} updated by change(*qkv)) raises ``error`` with ``message``."""
    args = dict(zip(names, qkv))
    args.update(change(*qkv))
    with pytest.raises(error, match=re.escape(message)):
        fn(**args)


@pytest.mark.parametrize("change, error, message", FLASH_CASES)
def test_flash_attn_func_rejects(change, error, message):
    _assert_rejects(flashtile.flash_attn_func, ("q", "k", "v"), _qkv(), change, error,
                    message)


PACKED_CASES = [
    pytest.param(lambda: flashtile.flash_attn_qkvpacked_func([[0.5]]), TypeError,
                 "qkv: expected a torch.Tensor, got list", id="qkv-non-tensor"),
    pytest.param(lambda: flashtile.flash_attn_qkvpacked_func(torch.randn(B, S, 2, H, D)),
                 ValueError, f"qkv.shape: expected a 5-d tensor with size 3 at dim 2, got "
                 f"{(B, S, 2, H, D)}", id="qkv-size-2"),
    pytest.param(lambda: flashtile.flash_attn_qkvpacked_func(torch.randn(B, S, 3 * H, D)),
                 ValueError, f"qkv: expected a 5-d tensor, got shape {(B, S, 3 * H, D)}",
                 id="qkv-rank-4"),
    pytest.param(lambda: flashtile.flash_attn_qkvpacked_func(
                     torch.randn(B, S, 3, H, D).int()), TypeError,
                 "qkv: expected dtype float16, bfloat16 or float32, got torch.int32",
                 id="qkv-int32"),
    pytest.param(lambda: flashtile.flash_attn_qkvpacked_func(
                     torch.randn(B, S, 3, H, D), window_size=(0, -2)), ValueError,
                 "window_size: expected each bound >= 0, or -1 for unbounded, got (0, -2)",
                 id="qkv-window"),
    pytest.param(lambda: flashtile.flash_attn_kvpacked_func(
                     torch.randn(B, S, H, D), torch.randn(B, S, 3, HKV, D)), ValueError,
                 f"kv.shape: expected a 5-d tensor with size 2 at dim 2, got "
                 f"{(B, S, 3, HKV, D)}", id="kv-size-3"),
    pytest.param(lambda: flashtile.flash_attn_kvpacked_func(
                     torch.randn(B, S, H, D), torch.randn(B, S, 2, HKV, D).half()),
                 TypeError, "k.dtype: expected q's dtype torch.float32, got torch.float16",
                 id="kv-dtype-mismatch"),
    pytest.param(lambda: flashtile.flash_attn_kvpacked_func(
                     torch.randn(B, S, H, D), torch.randn(B, S, 2, HKV, D), softcap=-0.5),
                 ValueError, "softcap: expected a finite float >= 0.0, got -0.5",
                 id="kv-softcap"),
    pytest.param(lambda: flashtile.flash_attn_kvpacked_func(
                     torch.randn(B, S, H, D), torch.randn(B, S, 2, HKV, D), dropout_p=1.5),
                 ValueError, "dropout_p: expected a probability in [0, 1), got 1.5",
                 id="kv-dropout-1.5"),
]


@pytest.mark.parametrize("call, error, message", PACKED_CASES)
def test_packed_rejects(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def _flag_call(fn_name):
    """A valid call of a public function, taking one extra keyword argument."""
    q, k, v = _qkv()
    cu = torch.tensor([0, S], dtype=torch.int32)
    calls = {
        "flash_attn_func": lambda **kw: flashtile.flash_attn_func(q, k, v, **kw),
        "flash_attn_qkvpacked_func": lambda **kw: flashtile.flash_attn_qkvpacked_func(
            torch.randn(B, S, 3, H, D), **kw),
        "flash_attn_varlen_func": lambda **kw: flashtile.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, S, S, **kw),
        "flash_attn_varlen_kvpacked_func":
            lambda **kw: flashtile.flash_attn_varlen_kvpacked_func(
                q[0], torch.randn(S, 2, HKV, D), cu, cu, S, S, **kw),
        "scaled_dot_product_attention":
            lambda **kw: flashtile.scaled_dot_product_attention(*_sdpa_inputs(), **kw),
        "flash_attn_with_kvcache": lambda **kw: flashtile.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=S, **kw),
    }
    return calls[fn_name]


# Regression (issue 13, item 8): causal="yes" was taken as True. Every flag is a bool.
FLAG_CASES = [
    *((fn, flag) for fn in ("flash_attn_func", "flash_attn_qkvpacked_func",
                            "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func")
      for flag in ("causal", "deterministic", "return_attn_probs", "return_lse")),
    ("scaled_dot_product_attention", "is_causal"),
    ("scaled_dot_product_attention", "enable_gqa"),
    *(("flash_attn_with_kvcache", flag) for flag in (
        "causal", "rotary_interleaved", "return_softmax_lse", "return_lse")),
]


@pytest.mark.parametrize("fn_name, flag", FLAG_CASES)
@pytest.mark.parametrize("value", ["yes", 1, None], ids=["str", "int", "None"])
def test_flags_must_be_bools(fn_name, flag, value):
    with pytest.raises(TypeError, match=re.escape(
            f"{flag}: expected a bool, got {type(value).__name__} {value!r}")):
        _flag_call(fn_name)(**{flag: value})


def _sdpa_inputs(b=B, h=H, hkv=H, s=S, d=D):
    """query (b, h, s, d) and key/value (b, hkv, s, d): torch's SDPA layout."""
    return (torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d))


SDPA_CASES = [
    pytest.param(lambda q, k, v: dict(attn_mask=torch.ones(3, 5, dtype=torch.bool)),
                 ValueError, f"attn_mask.shape: expected broadcastable to {(B, H, S, S)}, "
                 "got (3, 5)", id="mask-shape"),
    pytest.param(lambda q, k, v: dict(attn_mask=torch.ones(S, S, dtype=torch.int32)),
                 TypeError, "attn_mask.dtype: expected torch.bool or the query's dtype "
                 "torch.float32, got torch.int32", id="mask-int32"),
    pytest.param(lambda q, k, v: dict(attn_mask=torch.zeros(S, S, dtype=torch.float16)),
                 TypeError, "attn_mask.dtype: expected torch.bool or the query's dtype "
                 "torch.float32, got torch.float16", id="mask-float16-for-float32"),
    pytest.param(lambda q, k, v: dict(attn_mask=torch.ones(S, S, dtype=torch.bool,
                                                           device="meta")),
                 ValueError, "attn_mask.device: expected the query's device cpu, got meta",
                 id="mask-device"),
    pytest.param(lambda q, k, v: dict(attn_mask=[[True] * S] * S), TypeError,
                 "attn_mask: expected a torch.Tensor or None, got list", id="mask-list"),
    pytest.param(lambda q, k, v: dict(attn_mask=torch.ones(S, S, dtype=torch.bool),
                                      is_causal=True),
                 ValueError, "attn_mask and is_causal=True were both given",
                 id="mask-and-is_causal"),
    pytest.param(lambda q, k, v: dict(attn_mask=torch.randn(S, S, requires_grad=True)),
                 NotImplementedError, "attn_mask.requires_grad=True",
                 id="mask-requires-grad"),
    pytest.param(lambda q, k, v: dict(key=torch.randn(B, 2, S, D),
                                      value=torch.randn(B, 2, S, D)),
                 ValueError, f"key.shape[1] (nheads): expected query's nheads {H}, got 2. "
                 "Try setting enable_gqa=True", id="gqa-without-enable_gqa"),
    pytest.param(lambda q, k, v: dict(key=torch.randn(B, 3, S, D),
                                      value=torch.randn(B, 3, S, D),
                                      enable_gqa=True),
                 ValueError, f"key.shape[1] (nheads): expected a divisor of query's nheads "
                 f"{H} (GQA/MQA), got 3", id="gqa-nheads-not-divisor"),
    pytest.param(lambda q, k, v: dict(value=torch.randn(B, H, S + 1, D)), ValueError,
                 f"value.shape[:-1]: expected key's {(B, H, S)}, "
                 f"got {(B, H, S + 1)}",
                 id="value-seqlen"),
    pytest.param(lambda q, k, v: dict(key=torch.randn(B, H, S, 8),
                                      value=torch.randn(B, H, S, 8)),
                 ValueError, "key.shape[-1] (head_dim): expected query's head_dim 16, got 8",
                 id="key-value-head_dim"),
    pytest.param(lambda q, k, v: dict(key=k.half()), TypeError,
                 "key.dtype: expected query's dtype torch.float32, got torch.float16",
                 id="dtype-mismatch"),
    pytest.param(lambda q, k, v: dict(value=v.to("meta")), ValueError,
                 "value.device: expected query's device cpu, got meta",
                 id="device-mismatch"),
    pytest.param(lambda q, k, v: dict(query=q.int()), TypeError,
                 "query: expected dtype float16, bfloat16 or float32, got torch.int32",
                 id="int32"),
    pytest.param(lambda q, k, v: dict(value=3), TypeError,
                 "value: expected a torch.Tensor, got int", id="non-tensor"),
    pytest.param(lambda q, k, v: dict(query=q[0, 0]), ValueError,
                 f"query: expected a 4-d (batch, heads, seq, dim) or 3-d tensor (or more "
                 f"batch dims in front), got shape {(S, D)}", id="rank-2"),
    pytest.param(lambda q, k, v: dict(query=q[None].expand(2, *q.shape),
                                      key=k[None].expand(2, 3, *k.shape[1:]),
                                      value=v[None].expand(2, 3, *v.shape[1:])), ValueError,
                 f"key.shape[:-3] (batch dims): expected query's {(2, B)}, got {(2, 3)}",
                 id="rank-5-batch-dims"),
    pytest.param(lambda q, k, v: dict(key=k[0], value=v[0]), ValueError,
                 "key/value rank: expected query's rank 4, got (3, 3)", id="rank-mismatch"),
    pytest.param(lambda q, k, v: dict(key=torch.randn(B, D, S, H).transpose(1, 3)),
                 ValueError,
                 f"key.stride(-1): expected 1 (the head dim contiguous), got {S * H}",
                 id="key-last-dim-strided"),
    pytest.param(lambda q, k, v: dict(dropout_p=1.5), ValueError,
                 "dropout_p: expected a probability in [0, 1), got 1.5", id="dropout-1.5"),
    pytest.param(lambda q, k, v: dict(scale=float("nan")), ValueError,
                 "scale: expected a finite float, got nan", id="scale-nan"),
    # Regression: with 3-d inputs a non-tensor mask raised AttributeError ('list' object
    # has no attribute 'dim') before validation; it now gets the TypeError.
    pytest.param(lambda q, k, v: dict(query=q[:, 0], key=k[:, 0], value=v[:, 0],
                                      attn_mask=[[True] * S] * S),
                 TypeError, "attn_mask: expected a torch.Tensor or None, got list",
                 id="3d-mask-list"),
]


@pytest.mark.parametrize("change, error, message", SDPA_CASES)
def test_sdpa_rejects(change, error, message):
    _assert_rejects(flashtile.scaled_dot_product_attention, ("query", "key", "value"),
                    _sdpa_inputs(), change, error, message)


# ---------------------------------------------------------------------------------------
# Valid edge input: no error, no NaN, the oracle's numbers, on both backends.

@pytest.fixture(params=[
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")),
])
def backend(request, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", request.param)
    return request.param


def _forward_backward(fn, inputs, dout, dlse=None):
    """(out, lse, (dq, dk, dv)) of ``fn(q, k, v) -> (out, lse)`` for fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = fn(*leaves)
    outputs, grads = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    lse = None if lse is None else lse.detach()
    return out.detach(), lse, torch.autograd.grad(outputs, leaves, grads)


# The floor covers the case where torch's fp32 error happens to be 0 (with seqlen_k=1,
# dk is exactly 0 and torch's autograd gets 0 by luck): a sum of ~40 products of size
# up to ~4 (dout . v with head_dim 16) carries about 40 * 4 * 6e-8 = 1e-5 of rounding.
FLOOR = 1e-5


def _assert_accurate(name, ours, ref64, ref32, floor=FLOOR):
    """Style rule 9: err(ours) <= 2 * err(torch fp32) + floor, both against float64."""
    assert not ours.isnan().any(), f"{name} has NaN"
    if ours.numel() == 0:
        return
    err = (ours.double() - ref64).abs().max().item()
    torch_err = (ref32.double() - ref64).abs().max().item()
    assert err <= 2 * torch_err + floor, (
        f"{name}: max abs error {err:.3g} > 2 x torch fp32 error {torch_err:.3g} + {floor}")


def _check_against_oracle(q, k, v, kwargs):
    """Compare out, lse and (out-only) gradients with the float64 and fp32 oracles."""
    dout = torch.randn_like(q)

    def ours(q, k, v):
        return flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)

    def oracle(q, k, v, upcast):
        return attention_naive(q, k, v, upcast=upcast, **kwargs)

    out, lse, grads = _forward_backward(ours, (q, k, v), dout)
    out64, lse64, grads64 = _forward_backward(lambda *x: oracle(*x, True),
                                              [x.double() for x in (q, k, v)], dout)
    out32, lse32, grads32 = _forward_backward(lambda *x: oracle(*x, False), (q, k, v), dout)
    _assert_accurate("out", out, out64, out32)
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isinf(lse), empty), "lse is -inf exactly where no key is seen"
    assert (lse[empty] == float("-inf")).all()
    fin = ~empty
    _assert_accurate("lse", lse[fin], lse64[fin], lse32[fin])
    for name, g, g64, g32 in zip(("dq", "dk", "dv"), grads, grads64, grads32):
        _assert_accurate(name, g, g64, g32)
    return empty


# (id, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, flash_attn_func kwargs)
EDGE_CASES = [
    pytest.param(2, 1, 37, 4, 2, 16, {}, id="seqlen_q=1"),
    pytest.param(2, 1, 37, 4, 2, 16, dict(causal=True), id="seqlen_q=1-causal"),
    pytest.param(2, 37, 1, 2, 1, 13, {}, id="seqlen_k=1"),
    pytest.param(1, 1, 1, 3, 3, 32, dict(causal=True), id="seqlen_q=seqlen_k=1-causal"),
    pytest.param(1, 29, 11, 4, 2, 16, dict(causal=True), id="causal-seqlen_q>seqlen_k"),
    pytest.param(2, 37, 1, 2, 1, 13, dict(causal=True), id="causal-seqlen_k=1"),
    pytest.param(1, 23, 7, 2, 2, 24, dict(window_size=(1, 2)), id="window-empty-rows"),
    pytest.param(1, 19, 17, 4, 1, 16, dict(window_size=(0, 0)), id="window-0-0-mqa"),
]


@pytest.mark.parametrize("b, sq, sk, h, hkv, d, kwargs", EDGE_CASES)
def test_edge_matches_oracle(backend, b, sq, sk, h, hkv, d, kwargs):
    torch.manual_seed(0)
    _check_against_oracle(*_qkv(b, sq, sk, h, hkv, d), kwargs)


@pytest.mark.parametrize("sq, sk, kwargs", [
    pytest.param(29, 11, dict(causal=True), id="causal-seqlen_q>seqlen_k"),
    pytest.param(23, 7, dict(window_size=(1, 2)), id="window"),
    pytest.param(23, 7, dict(window_size=(1, 2), softcap=5.0,
                             alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
                 id="window-softcap-alibi"),
])
def test_rows_without_keys(backend, sq, sk, kwargs):
    """Bottom-right alignment: query i sees keys j <= i + sk - sq (+ right), so with
    sq > sk the first rows see no key: out 0, lse -inf, and zero (not NaN) gradients,
    even when the loss uses lse."""
    torch.manual_seed(0)
    q, k, v = _qkv(1, sq, sk, H, HKV, 16)
    empty_rows = _check_against_oracle(q, k, v, kwargs)[0, 0]   # (sq,), same for all heads
    right = 0 if kwargs.get("causal") else kwargs["window_size"][1]
    assert empty_rows.sum().item() == sq - sk - right           # rows i < sq - sk - right

    def ours(q, k, v):
        return flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)

    out, lse, (dq, dk, dv) = _forward_backward(ours, (q, k, v), torch.randn_like(q),
                                               dlse=torch.randn(1, H, sq))
    assert (out[:, empty_rows] == 0).all()
    assert (lse[..., empty_rows] == float("-inf")).all()
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} is not finite"
    assert (dq[:, empty_rows] == 0).all()


def test_seqlen_k_zero(backend):
    torch.manual_seed(0)
    q, k, v = _qkv(2, 5, 0, H, HKV, 16)

    def ours(q, k, v):
        return flashtile.flash_attn_func(q, k, v, return_lse=True)

    out, lse, (dq, dk, dv) = _forward_backward(ours, (q, k, v), torch.randn_like(q),
                                               dlse=torch.randn(2, H, 5))
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (2, H, 5) and (lse == float("-inf")).all()
    assert (dq == 0).all()
    assert dk.shape == k.shape and dv.shape == v.shape


def test_batch_zero_forward(backend):
    q, k, v = _qkv(0, 7, 9, H, HKV, 16)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (0, H, 7)


def test_batch_zero_backward(backend):
    # Regression: the tiled backward once reshaped dk/dv with -1 over a zero batch.
    q, k, v = _qkv(0, 7, 9, H, HKV, 16)

    def ours(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)

    _, _, grads = _forward_backward(ours, (q, k, v), torch.randn_like(q))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_sdpa_fully_masked_row(backend):
    """SDPA: a query whose bool mask row is all False returns 0 with finite gradients."""
    torch.manual_seed(0)
    b, h, sq, sk, d = 2, 3, 13, 11, 16
    query = torch.randn(b, h, sq, d)
    key, value = torch.randn(b, h, sk, d), torch.randn(b, h, sk, d)
    mask = torch.rand(sq, sk) > 0.3
    mask[4] = False
    dout = torch.randn_like(query)

    def ours(q, k, v):
        return flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask), None

    out, _, grads = _forward_backward(ours, (query, key, value), dout)
    assert (out[:, :, 4] == 0).all()
    for name, g in zip(("dquery", "dkey", "dvalue"), grads):
        assert torch.isfinite(g).all(), f"{name} is not finite"
    assert (grads[0][:, :, 4] == 0).all()

    def oracle(q, k, v, upcast):  # flash-attn's layout, SDPA's top-left alignment
        out, lse = attention_naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   attn_mask=mask, diag_offset=0, upcast=upcast)
        return out.transpose(1, 2), lse

    out64, _, grads64 = _forward_backward(lambda *x: oracle(*x, True),
                                          [x.double() for x in (query, key, value)], dout)
    out32, _, grads32 = _forward_backward(lambda *x: oracle(*x, False),
                                          (query, key, value), dout)
    _assert_accurate("out", out, out64, out32)
    for name, g, g64, g32 in zip(("dquery", "dkey", "dvalue"), grads, grads64, grads32):
        _assert_accurate(name, g, g64, g32)


def test_tensor_beyond_32bit_offsets_is_refused():
    """Regression: the kernels use 32-bit offsets; a view reaching past 2**31 elements
    must be an error, not a wrapped address. Built as a stride-0 view, so no memory."""
    base = torch.randn(1, 1, 1, 16)
    huge = base.expand(2**17, 2**15, 1, 16)  # stride 0: no memory, but 2**36 elements
    assert huge.numel() > 2**31
    # A small view whose batch stride reaches past 2**31 (meta: no storage needed).
    q = torch.empty_strided((2, 3, 1, 16), (2**31, 16, 16, 1), device="meta")
    with pytest.raises(ValueError, match="32-bit offsets"):
        flashtile.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="32-bit offsets"):
        flashtile.flash_attn_func(huge, huge, huge)


def test_broadcast_mask_past_2_31_elements_is_accepted():
    """Regression: a (1, 1, sq, sk) mask broadcast to (8, 32, 4096, 4096) has 2**32
    elements but reaches only sq * sk of them (stride 0 over batch and heads), and no
    tensor of its shape is allocated: it must not be refused as past 32-bit offsets.
    One whose own strides reach past 2**31 still is. Meta tensors: no memory."""
    from flashtile._validate import check_attn_mask

    mask = torch.empty(1, 1, 4096, 4096, dtype=torch.bool, device="meta")
    expanded = check_attn_mask(mask, 8, 32, 4096, 4096, torch.device("meta"), torch.bfloat16)
    assert expanded.shape == (8, 32, 4096, 4096) and expanded.numel() > 2**31
    far = torch.empty_strided((2, 1, 16, 16), (2**31, 256, 16, 1), dtype=torch.bool,
                              device="meta")
    with pytest.raises(ValueError, match="32-bit offsets"):
        check_attn_mask(far, 2, 4, 16, 16, torch.device("meta"), torch.bfloat16)
