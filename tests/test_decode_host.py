"""The host path of eager decode and forward calls (issue 15): the outputs a decode call
allocates (fewer allocations, still its own memory) and the memo that checks each
layout of the arguments once (it must never let bad input through, nor change a
result)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import flashtile
from flashtile import _validate as V
from flashtile import inference, interface
from flashtile.ops import decode
from flashtile.reference import attention_naive
from utils import assert_close_rule


def _byte_range(ptr, n_bytes):
    return range(ptr, ptr + n_bytes)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("shape", [(1, 1, 32, 128), (3, 5, 7, 13), (2, 1, 1, 1)],
                         ids=["b1_h32_d128", "odd", "tiny"])
def test_decode_outputs_are_disjoint_aligned_and_inside_their_allocation(
        shape, splits, return_lse, dtype):
    """The pieces of attn_decode's allocations (out, lse, the split partials) never
    overlap, each starts 16-byte aligned (what a launch plan's key assumes of the
    outputs) and ends inside its allocation; out and a returned lse are contiguous
    (b, sq, h, dv) and (b, h, sq) tensors."""
    b, sq, h, dv = shape
    q = torch.empty(b, sq, h, 8)
    out, lse, buf, lse_at, dst_at, dst_lse_at = decode._outputs(q, dv, dtype, splits,
                                                                return_lse)
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype and out.is_contiguous()
    assert (lse is not None) == return_lse
    if return_lse:
        assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
        assert lse.is_contiguous() and lse.data_ptr() == buf.data_ptr() + lse_at
    base = buf.data_ptr()
    pieces = {"lse": (base + lse_at, 4 * b * h * sq)}
    if splits > 1:
        pieces["dst"] = (base + dst_at, 4 * splits * b * sq * h * dv)
        pieces["dst_lse"] = (base + dst_lse_at, 4 * splits * b * h * sq)
    pieces["out"] = (out.data_ptr(), out.numel() * out.element_size())
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                for x in (out, buf)}
    for name, (ptr, n) in pieces.items():
        assert ptr % 16 == 0, name
        assert any(s <= ptr and ptr + n <= s + size for s, size in storages.items()), name
    spans = sorted(pieces.values())
    for (p0, n0), (p1, _) in zip(spans, spans[1:]):
        assert p0 + n0 <= p1, pieces


def _reference_decode(q, k_cache, v_cache, seqlens, block_table=None):
    """float64 out and lse of each sequence over its cache_seqlens keys, and PyTorch's
    own result at q's dtype (the accuracy rule's yardstick), batch by batch."""
    refs = {True: ([], []), False: ([], [])}
    for i, n in enumerate(seqlens.tolist()):
        if block_table is not None:
            page = k_cache.shape[1]
            rows = block_table[i, :-(-n // page)].long()
            k, v = (x[rows].flatten(0, 1)[None, :n] for x in (k_cache, v_cache))
        else:
            k, v = k_cache[i:i + 1, :n], v_cache[i:i + 1, :n]
        for upcast in (True, False):
            o, l = attention_naive(q[i:i + 1], k, v, causal=True, upcast=upcast)
            refs[upcast][0].append(o)
            refs[upcast][1].append(l)
    return [(torch.cat(o), torch.cat(l)) for o, l in (refs[True], refs[False])]


def _check_decode(q, k_cache, v_cache, seqlens, block_table=None, **kw):
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 block_table=block_table, causal=True,
                                                 return_lse=True, **kw)
    alone = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             block_table=block_table, causal=True, **kw)
    (out64, lse64), (out_t, _) = _reference_decode(q, k_cache, v_cache, seqlens, block_table)
    assert_close_rule("out", out, out64, out_t)
    assert_close_rule("out without lse", alone, out64, out_t)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-4, atol=1e-4)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_outputs_are_right_and_their_own(num_splits, dtype, backend, device):
    """With and without lse, split and not: out and lse against float64, and a second
    call with other inputs leaves the first call's outputs as they were (nothing of an
    output is shared with a later call)."""
    b, s, h, hkv, d = 2, 80, 4, 2, 16
    f = dict(device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(b, s, hkv, d, **f) for _ in "kv")
    seqlens = torch.tensor([37, 80], dtype=torch.int32, device=device)
    q = torch.randn(b, 1, h, d, **f)
    out, lse = _check_decode(q, k_cache, v_cache, seqlens, num_splits=num_splits)
    kept = out.clone(), lse.clone()
    alone = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             causal=True, num_splits=num_splits)
    kept_alone = alone.clone()
    flashtile.flash_attn_with_kvcache(torch.randn_like(q), k_cache, v_cache,
                                      cache_seqlens=seqlens - 5, causal=True,
                                      num_splits=num_splits, return_lse=True)
    flashtile.flash_attn_with_kvcache(torch.randn_like(q), k_cache, v_cache,
                                      cache_seqlens=seqlens - 5, causal=True,
                                      num_splits=num_splits)
    assert torch.equal(out, kept[0]) and torch.equal(lse, kept[1])
    assert torch.equal(alone, kept_alone)


def test_calls_without_lse_under_inference_mode(backend, device):
    """Regression: under torch.inference_mode a view has no ``_base``, and the first
    decode or forward without lse (Triton's own path, which takes lse as a tensor
    found through out's allocation) raised AttributeError (the engine's model test)."""
    k_cache, v_cache = (torch.randn(2, 48, 2, 16, device=device) for _ in "kv")
    seqlens = torch.tensor([7, 48], dtype=torch.int32, device=device)
    q = torch.randn(2, 1, 4, 16, device=device)
    qf, kf, vf = (torch.randn(1, 9, 2, 16, device=device) for _ in range(3))
    with torch.inference_mode():
        decoded = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                    cache_seqlens=seqlens, causal=True,
                                                    num_splits=1)
        out = flashtile.flash_attn_func(qf, kf, vf, causal=True)
    (out64, _), (out_t, _) = _reference_decode(q, k_cache, v_cache, seqlens)
    assert_close_rule("decode", decoded, out64, out_t)
    assert_close_rule("forward", out, attention_naive(qf, kf, vf, causal=True)[0],
                      attention_naive(qf, kf, vf, causal=True, upcast=False)[0])


def _paged_inputs(device, dtype=torch.float32):
    f = dict(device=device, dtype=dtype)
    q = torch.randn(2, 1, 4, 16, **f)
    pool_k, pool_v = (torch.randn(9, 16, 2, 16, **f) for _ in "kv")
    table = torch.randperm(9)[:8].view(2, 4).to(torch.int32).to(device)
    seqlens = torch.tensor([23, 64], dtype=torch.int32, device=device)
    return q, pool_k, pool_v, table, seqlens


def _bad_calls(q, pool_k, pool_v, table, seqlens):
    """(name, kwargs, error, message): calls with the good call's shapes, or the same
    arguments of another kind, that must raise."""
    device = q.device
    wide_v = torch.randn(*pool_v.shape[:-1], 2 * pool_v.shape[-1], device=device)[..., ::2]
    return [
        ("cache_seqlens int64", dict(cache_seqlens=seqlens.long()), TypeError,
         "cache_seqlens.dtype: expected torch.int32"),
        ("block_table of another shape", dict(block_table=torch.cat([table, table], 1)[:1]),
         ValueError, "block_table.shape"),
        ("block_table float", dict(block_table=table.float()), TypeError,
         "block_table.dtype"),
        ("block_table a list", dict(block_table=table.tolist()), ValueError,
         "block_table: expected an int32 tensor"),
        ("cache_seqlens on another device",
         dict(cache_seqlens=torch.empty(2, dtype=torch.int32, device="meta")), ValueError,
         "cache_seqlens.device"),
        ("v_cache's head dim strided", dict(v_cache=wide_v), ValueError,
         r"v_cache.stride\(-1\)"),
        ("k_cache a subclass with a bad dtype",
         dict(k_cache=torch.nn.Parameter(pool_k.double(), requires_grad=False)),
         TypeError, "k_cache"),
        ("q of another head dim stride",
         dict(q=torch.randn(2, 1, 4, 32, device=device)[..., ::2]),
         ValueError, r"q.stride\(-1\)"),
    ]


def test_checks_after_a_good_call_still_raise(device):
    """The memo of checked layouts serves no call whose arguments differ in anything the
    checks read: after a good call, the same shapes with a bad dtype, device, stride
    or kind raise as they do in a fresh process, every time."""
    q, pool_k, pool_v, table, seqlens = _paged_inputs(device)
    good = dict(q=q, k_cache=pool_k, v_cache=pool_v, block_table=table,
                cache_seqlens=seqlens)
    for name, change, error, message in _bad_calls(q, pool_k, pool_v, table, seqlens):
        for _ in range(2):
            flashtile.flash_attn_with_kvcache(**good)
            with pytest.raises(error, match=message):
                flashtile.flash_attn_with_kvcache(**{**good, **change})


def test_overlapping_caches_are_refused_on_every_append(device):
    """Whether v_cache shares k_cache's elements is read from addresses, not layouts:
    checked on every call with new k and v, also after a call of the same layouts."""
    q, pool_k, _, table, seqlens = _paged_inputs(device)
    kv = torch.randn(*pool_k.shape[:-1], 32, device=device)
    k_new = torch.randn(2, 1, 2, 16, device=device)
    apart = dict(cache_seqlens=seqlens - 1, block_table=table, k=k_new, v=k_new)
    flashtile.flash_attn_with_kvcache(q, kv[..., :16], kv[..., 16:], **apart)
    with pytest.raises(ValueError, match="k/v: expected None when v_cache and k_cache"):
        flashtile.flash_attn_with_kvcache(q, kv[..., :16], kv[..., 8:24], **apart)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_memo_serves_right_numbers_after_layouts_change(dtype, backend, device):
    """Calls that alternate between layouts of one shape (a cache that is a strided view,
    non-contiguous index tensors, a transposed q) each give their own right answer."""
    f = dict(device=device, dtype=dtype)
    q, pool_k, pool_v, table, seqlens = _paged_inputs(device, dtype)
    wide = torch.randn(*pool_k.shape[:-1], 3 * pool_k.shape[-1], **f)
    strided_k, strided_v = wide[..., :16], wide[..., 32:]
    strided_k.copy_(pool_k)
    strided_v.copy_(pool_v)
    table_t = table.t().contiguous().t()             # same shape, column-major
    seqlens_s = torch.stack([seqlens, seqlens], 1)[:, 0]  # stride 2
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    for args in [(q, pool_k, pool_v, seqlens, table), (q, strided_k, strided_v, seqlens, table),
                 (q_t, pool_k, pool_v, seqlens_s, table_t), (q, pool_k, pool_v, seqlens, table),
                 (q_t, strided_k, strided_v, seqlens_s, table)]:
        _check_decode(*args)
    k_cache = torch.randn(2, 64, 2, 16, **f)
    _check_decode(q, k_cache, k_cache, seqlens)
    _check_decode(q, k_cache.transpose(0, 1).contiguous().transpose(0, 1), k_cache, seqlens)


def test_forward_checks_after_a_good_call_still_raise():
    q, k, v = (torch.randn(1, 20, 4, 16) for _ in range(3))
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v)
        with pytest.raises(TypeError, match="k.dtype: expected q's dtype"):
            flashtile.flash_attn_func(q, k.half(), v)
        with pytest.raises(ValueError, match=r"v.stride\(-1\)"):
            flashtile.flash_attn_func(q, k, torch.randn(1, 20, 4, 32)[..., ::2])
        with pytest.raises(ValueError, match="k.device"):
            flashtile.flash_attn_func(q, k.to("meta"), v)
        with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
            flashtile.flash_attn_func(q.numpy(), k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_memo_serves_right_numbers_after_layouts_change(dtype, backend, device):
    f = dict(device=device, dtype=dtype)
    q, k, v = (torch.randn(2, 24, 4, 16, **f) for _ in range(3))
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    for args in [(q, k, v), views, (q, views[1], v), (q, k, v)]:
        out = flashtile.flash_attn_func(*args, causal=True)
        ref64 = attention_naive(*args, causal=True)[0]
        ref_t = attention_naive(*args, causal=True, upcast=False)[0]
        assert_close_rule("out", out, ref64, ref_t)


def test_once_per_layout_checks_each_new_layout_and_keeps_no_tensor():
    calls = []

    def check(x, y):
        calls.append(1)
        if x.dtype == torch.float64:
            raise TypeError("x.dtype")
        return x.shape[0]

    checked = V.once_per_layout(check)
    x = torch.randn(4, 3)
    assert checked(x, None) == 4 and checked(x.clone(), None) == 4 and len(calls) == 1
    for other in (x.t().contiguous().t(), x.to("meta"), x.half(), x[:2],
                  torch.nn.Parameter(x)):
        checked(other, None)
    checked(x, x)
    assert len(calls) == 7
    checked(torch.nn.Parameter(x), None)  # not a plain tensor: checked on every call
    assert len(calls) == 8
    for _ in range(2):
        with pytest.raises(TypeError):
            checked(x.double(), None)
    assert len(calls) == 10
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None


def test_memos_are_bounded(monkeypatch):
    monkeypatch.setattr(V, "MAX_LAYOUTS", 3)
    checked = V.once_per_layout(lambda x: x.shape[0])
    for n in range(1, 8):
        assert checked(torch.empty(n)) == n
    assert len(checked.cache_clear.__self__) <= 3  # the memo itself


def test_decode_and_forward_use_the_memo():
    """The public calls go through the memoized checks (a refactor that drops them
    would bring the host time back, not fail a numeric test)."""
    assert inference._check_cache_once.__wrapped__ is inference._check_cache
    assert interface._check_qkv.__wrapped__.func is V.check_qkv


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_varlen_without_lse_matches_with_lse(paged, backend, device):
    """A varlen forward that returns no lse (out and lse in one allocation on the
    Triton path) gives the out of one that returns it, in plain eager mode, under
    torch.inference_mode (views without a _base) and with an odd total length (lse's
    words after out's still 16-byte aligned)."""
    h, hkv, d = 4, 2, 16
    lengths = [5, 0, 12]
    total = sum(lengths)
    cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=device)
    q = torch.randn(total, h, d, device=device)
    kw = dict(causal=True)
    if paged:  # each sequence's keys in two pages of 16 of a pool of 6
        k, v = (torch.randn(6, 16, hkv, d, device=device) for _ in "kv")
        kw.update(block_table=torch.randperm(6).view(3, 2).to(torch.int32).to(device))
    else:
        k, v = (torch.randn(total, hkv, d, device=device) for _ in "kv")
    out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, return_lse=True,
                                                **kw)
    assert torch.equal(flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, **kw), out)
    with torch.inference_mode():
        alone = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, **kw)
    assert torch.equal(alone, out) and lse.shape == (h, total)
