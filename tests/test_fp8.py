"""FP8 attention (issue 17, item 1): flash_attn_func, flash_attn_varlen_func (packed and
paged) and flash_attn_with_kvcache with FP8 inputs and flash-attn 3's descales.

Every output is compared with attention computed in float64 from the dequantised inputs
(descale * x), within the bound derived in tests/fp8_utils.py from the rounding of P
before the P @ V product (e4m3: 2**-4 relative, e5m2: 2**-3) and of the output. Both
backends run: the PyTorch path (CPU; fp32, P exact), and the Triton kernels (GPU, or the
interpreter with its FP8 conversions fixed by the fp8_interpreter fixture).
"""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile import fp8 as F8
from flashtile.ops._fp8 import _fp16_rows
from flashtile.reference import attention_naive, gather_pages
from tests.fp8_utils import assert_within, error_bound, fp8_interpreter

__all__ = ["fp8_interpreter"]  # the fixture, imported to be used here

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])


@pytest.fixture
def fp8_backend(backend, on_gpu, request):
    """The conftest backend; the Triton interpreter gets correct FP8 conversions."""
    if backend == "triton" and not on_gpu:
        request.getfixturevalue("fp8_interpreter")
    return backend


def _out_dtype(on_gpu):
    # The interpreter truncates fp32 -> bf16 (test_interpreter_dtype.py): fp32 there.
    return torch.bfloat16 if on_gpu else torch.float32


def _quantized(shape, dtype, device, nheads_kv=None, spread=4.0):
    """An FP8 tensor and its descales (batch, nheads_kv): normal values times a factor
    per (batch, head) in [1/spread, spread], so every descale differs."""
    x = torch.randn(shape, device=device)
    x = x * torch.exp(torch.empty(shape[0], 1, shape[2], 1, device=device)
                      .uniform_(-math.log(spread), math.log(spread)))
    return F8.quantize(x, dtype=dtype, nheads_kv=nheads_kv)


def _dense_inputs(b, sq, sk, h, hkv, d, dtype, device):
    q, qd = _quantized((b, sq, h, d), dtype, device, nheads_kv=hkv)
    k, kd = _quantized((b, sk, hkv, d), dtype, device)
    v, vd = _quantized((b, sk, hkv, d), dtype, device)
    return (q, k, v), (qd, kd, vd)


def _reference(q, k, v, descales, **kw):
    """float64 (out, lse) of the dequantised inputs, and those inputs."""
    deq = [F8.dequantize(x, d).double() for x, d in zip((q, k, v), descales)]
    out, lse = attention_naive(*deq, **kw)
    return out, lse, deq


def _check(out, lse, q, k, v, descales, backend, kw, out_dtype, dtype=None):
    """out and lse within the derived bound of the float64 reference (dtype: the FP8
    format of P on the Triton path)."""
    ref, ref_lse, deq = _reference(q, k, v, descales, **kw)
    p_dtype = (dtype or q.dtype) if backend == "triton" else None
    scale = kw.get("softmax_scale") or q.shape[-1] ** -0.5
    bound, lse_bound = error_bound(*deq, ref, p_dtype=p_dtype, out_dtype=out_dtype,
                                   softmax_scale=scale, causal=kw.get("causal", False),
                                   window=kw.get("window_size", (-1, -1)),
                                   softcap=kw.get("softcap", 0.0),
                                   alibi_slopes=kw.get("alibi_slopes"))
    assert out.dtype == out_dtype
    assert_within("out", out, ref, bound)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert_within("lse", lse[seen], ref_lse[seen], lse_bound[seen])


def _check_each_sequence(out, lse, q, k_cache, v_cache, lengths, descales, backend, kw,
                         out_dtype, dtype=None):
    """``_check`` of each batch row over its first ``lengths[i]`` cache rows (descales:
    per batch row, or None)."""
    for i, n in enumerate(lengths):
        row = slice(i, i + 1)
        _check(out[row], lse[row], q[row], k_cache[row, :n], v_cache[row, :n],
               tuple(None if x is None else x[row] for x in descales), backend, kw,
               out_dtype, dtype=dtype)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, options)
DENSE = [
    pytest.param((2, 37, 53, 4, 2, 64, dict(causal=True)), id="gqa-causal-d64"),
    pytest.param((1, 45, 29, 2, 1, 40, dict(causal=True)), id="mqa-rows-see-nothing-d40"),
    pytest.param((1, 33, 70, 2, 2, 16, dict(window_size=(9, 3))), id="window-d16"),
    pytest.param((2, 21, 47, 4, 4, 32, dict(softcap=5.0, alibi="h")), id="softcap-alibi"),
    pytest.param((1, 17, 17, 2, 2, 256, {}), id="d256"),
]


@FP8
@pytest.mark.parametrize("case", DENSE)
def test_flash_attn_func(case, dtype, fp8_backend, device, on_gpu):
    b, sq, sk, h, hkv, d, kw = case
    (q, k, v), descales = _dense_inputs(b, sq, sk, h, hkv, d, dtype, device)
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(h, device=device) * 0.3
    out_dtype = _out_dtype(on_gpu)
    out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, q_descale=descales[0],
                                         k_descale=descales[1], v_descale=descales[2],
                                         out_dtype=out_dtype, **kw)
    _check(out, lse, q, k, v, descales, fp8_backend, kw, out_dtype)


@pytest.mark.parametrize("shape", [(), (1,), (2, 1), (2,)], ids=str)
def test_descale_broadcasting(shape, fp8_backend, device):
    """Per-tensor ((), (1,)), per-sequence ((batch, 1)) and per-head ((nheads_kv,))
    factors broadcast to (batch, nheads_kv) without a copy; None is 1.0."""
    (q, k, v), _ = _dense_inputs(2, 19, 23, 4, 2, 32, E4M3, device)
    scale = torch.rand(shape, device=device) + 0.5
    out = flashtile.flash_attn_func(q, k, v, k_descale=scale, out_dtype=torch.float32)
    full = scale.expand(2, 2).contiguous()
    ones = torch.ones(2, 2, device=device)
    expected = flashtile.flash_attn_func(q, k, v, q_descale=ones, k_descale=full,
                                         v_descale=ones, out_dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_descales_are_applied_per_sequence_and_kv_head(fp8_backend, device, on_gpu):
    """Descales of powers of two per (batch, KV head) give the same result as the same
    tensors scaled by them in FP8 (an exact exponent shift), with GQA: every factor
    reaches the right batch entry, KV head and query group; the kernels fold them into
    the score scale and the output, which power-of-two factors leave exact."""
    b, sq, sk, h, hkv, d = 2, 29, 41, 6, 3, 32
    gen = torch.Generator().manual_seed(3)
    # Normal e4m3 values in [1/4, 8): a shift by 2**-1 .. 2**2 stays normal and exact.
    def base(shape):
        x = torch.rand(shape, generator=gen) * 7.75 + 0.25
        return (x * torch.sign(torch.randn(shape, generator=gen))).to(E4M3).to(device)
    q, k, v = base((b, sq, h, d)), base((b, sk, hkv, d)), base((b, sk, hkv, d))
    exps = [torch.randint(-1, 3, (b, hkv), generator=gen) for _ in range(3)]
    descales = [(2.0 ** e).float().to(device) for e in exps]
    scaled = [(F8.dequantize(x, s)).to(E4M3) for x, s in zip((q, k, v), descales)]
    kw = dict(causal=True, return_lse=True, out_dtype=torch.float32)
    out, lse = flashtile.flash_attn_func(q, k, v, q_descale=descales[0],
                                         k_descale=descales[1], v_descale=descales[2], **kw)
    expected, expected_lse = flashtile.flash_attn_func(*scaled, **kw)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-6, atol=1e-6)


def test_default_output_is_bf16(fp8_backend, device):
    (q, k, v), descales = _dense_inputs(1, 8, 8, 2, 2, 16, E4M3, device)
    assert flashtile.flash_attn_func(q, k, v).dtype == torch.bfloat16
    assert flashtile.flash_attn_func(q, k, v, out_dtype=torch.float16).dtype == torch.float16


def test_attn_probs_of_dequantised_inputs(fp8_backend, device):
    (q, k, v), descales = _dense_inputs(1, 9, 13, 2, 1, 16, E5M2, device)
    _, _, probs = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                            q_descale=descales[0], k_descale=descales[1],
                                            v_descale=descales[2])
    qd, kd = (F8.dequantize(x, s).double() for x, s in zip((q, k), descales))
    s = torch.einsum("bihd,bjhd->bhij", qd, kd.repeat_interleave(2, 2)) / 4.0
    s = s.masked_fill(torch.ones(9, 13, dtype=torch.bool, device=device).tril(4).logical_not(),
                      float("-inf"))
    torch.testing.assert_close(probs.double(), s.softmax(-1), rtol=1e-6, atol=1e-7)


# ---- varlen: packed, and paged with a block table ----

def _packed(lengths, heads, d, dtype, device, nheads_kv=None):
    """Sequences of the given lengths back to back, FP8, and their descales (one row
    per sequence)."""
    parts = [_quantized((1, n, heads, d), dtype, device, nheads_kv) for n in lengths]
    # As bytes: not every torch build has FP8 kernels for cat and indexing.
    x = torch.cat([p[0][0].view(torch.uint8) for p in parts]).view(dtype)
    descale = torch.cat([p[1] for p in parts])
    return x, descale


def _gather(pool, table, n):
    """gather_pages on the bytes of an FP8 pool."""
    return gather_pages(pool.view(torch.uint8), table, 0, n).view(pool.dtype)


@FP8
def test_varlen_packed(dtype, fp8_backend, device, on_gpu):
    lens_q, lens_k = [7, 0, 23, 1], [19, 5, 23, 40]
    h, hkv, d = 4, 2, 48
    q, qd = _packed(lens_q, h, d, dtype, device, nheads_kv=hkv)
    k, kd = _packed(lens_k, hkv, d, dtype, device)
    v, vd = _packed(lens_k, hkv, d, dtype, device)
    cu_q, cu_k = (torch.tensor([0, *lens], device=device).cumsum(0).int()
                  for lens in (lens_q, lens_k))
    out_dtype = _out_dtype(on_gpu)
    out, lse = flashtile.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True,
        q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype)
    for i in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe == qs:
            continue
        seq = (q[None, qs:qe], k[None, ks:ke], v[None, ks:ke])
        _check(out[None, qs:qe], lse[None, :, qs:qe], *seq,
               (qd[i:i + 1], kd[i:i + 1], vd[i:i + 1]), fp8_backend, dict(causal=True),
               out_dtype)


@FP8
@pytest.mark.parametrize("page_size", [16, 64])
def test_varlen_paged(page_size, dtype, fp8_backend, device, on_gpu):
    """An FP8 pool: each sequence's keys take its own descales wherever its pages lie."""
    h, hkv, d = 4, 2, 32
    lens_q, used = [3, 9, 1], [40, 17, 64]
    blocks = 64 // page_size
    pool_k, pool_v = (torch.randn(3 * blocks + 2, page_size, hkv, d, device=device)
                      .to(dtype) for _ in range(2))
    table = torch.randperm(3 * blocks + 2, device=device)[:3 * blocks].view(3, blocks).int()
    q, qd = _packed(lens_q, h, d, dtype, device, nheads_kv=hkv)
    kd, vd = (torch.rand(3, hkv, device=device) + 0.5 for _ in range(2))
    cu_q = torch.tensor([0, *lens_q], device=device).cumsum(0).int()
    out_dtype = _out_dtype(on_gpu)
    out, lse = flashtile.flash_attn_varlen_func(
        q, pool_k, pool_v, cu_q, None, max(lens_q), 64, causal=True, return_lse=True,
        block_table=table, seqused_k=torch.tensor(used, dtype=torch.int32, device=device),
        q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype)
    for i, n in enumerate(used):
        k, v = (_gather(x, table[i], n)[None] for x in (pool_k, pool_v))
        qs, qe = cu_q[i], cu_q[i + 1]
        _check(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe], k, v,
               (qd[i:i + 1], kd[i:i + 1], vd[i:i + 1]), fp8_backend, dict(causal=True),
               out_dtype)


@FP8
@pytest.mark.parametrize("page_size", [16, 64])
def test_varlen_paged_16bit_queries(page_size, dtype, fp8_backend, device, on_gpu):
    """16-bit q over an FP8 pool (an engine's prefill chunks over an FP8 KV cache): the
    pool's tiles are widened to q's dtype, its descales applied per sequence, out in q's
    dtype; the Triton path rounds P to q's dtype for P @ V."""
    h, hkv, d = 4, 2, 32
    lens_q, used = [3, 9, 1, 0], [40, 17, 64, 5]
    blocks = 64 // page_size
    pool_k, pool_v = (torch.randn(4 * blocks + 2, page_size, hkv, d, device=device)
                      .to(dtype) for _ in range(2))
    table = torch.randperm(4 * blocks + 2, device=device)[:4 * blocks].view(4, blocks).int()
    q_dtype = _q_dtype(on_gpu)
    q = torch.randn(sum(lens_q), h, d, device=device).to(q_dtype)
    kd, vd = (torch.rand(4, hkv, device=device) + 0.5 for _ in range(2))
    cu_q = torch.tensor([0, *lens_q], device=device).cumsum(0).int()
    cu_k = torch.tensor([0, *used], device=device).cumsum(0).int()
    out, lse = flashtile.flash_attn_varlen_func(
        q, pool_k, pool_v, cu_q, cu_k, max(lens_q), 64, causal=True, return_lse=True,
        block_table=table, k_descale=kd, v_descale=vd)
    assert out.dtype == q_dtype
    p_dtype = q_dtype if fp8_backend == "triton" else None
    for i, n in enumerate(used):
        k, v = (_gather(x, table[i], n)[None] for x in (pool_k, pool_v))
        qs, qe = cu_q[i], cu_q[i + 1]
        if qe > qs:
            _check(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe], k, v,
                   (None, kd[i:i + 1], vd[i:i + 1]), fp8_backend, dict(causal=True),
                   q_dtype, dtype=p_dtype)


def test_fp8_pool_under_16bit_queries_rejects(device):
    """What a 16-bit q over an FP8 pool does not take, each named: q_descale, another
    output dtype, v in another format, packed (unpaged) FP8 k and v, fp32 q."""
    h, hkv, d, page = 2, 1, 16, 16
    pool = torch.randn(2, page, hkv, d, device=device).to(E4M3)
    q = torch.randn(3, h, d, device=device, dtype=torch.float16)
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    args = (cu_q, cu_k, 3, 20)
    one = torch.ones((), device=device)
    with pytest.raises(ValueError, match="q_descale"):
        flashtile.flash_attn_varlen_func(q, pool, pool, *args, block_table=table,
                                         q_descale=one)
    with pytest.raises(ValueError, match="out_dtype"):
        flashtile.flash_attn_varlen_func(q, pool, pool, *args, block_table=table,
                                         out_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"v\.dtype.*float8 pool"):
        flashtile.flash_attn_varlen_func(q, pool, pool.to(E5M2), *args, block_table=table)
    with pytest.raises(TypeError, match=r"k\.dtype"):
        flashtile.flash_attn_varlen_func(q, pool[0], pool[0], *args)
    with pytest.raises(TypeError, match=r"k\.dtype"):
        flashtile.flash_attn_varlen_func(q.float(), pool, pool, *args, block_table=table)


# ---- flash_attn_with_kvcache: FP8 caches, 16-bit or FP8 queries ----

def _q_dtype(on_gpu):
    return torch.bfloat16 if on_gpu else torch.float16  # bf16: no interpreter


@FP8
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_16bit_queries(num_splits, paged, dtype, fp8_backend, device, on_gpu):
    """16-bit queries over an FP8 cache: the new k/v are quantised into the cache bit for
    bit as quantize(k, k_descale), and the output is attention over the dequantised
    cache, P rounded to fp16 (the decode kernel computes in fp16 over an FP8 cache)."""
    b, s, h, hkv, d, page = 3, 96, 8, 2, 64, 16
    q_dtype = _q_dtype(on_gpu)
    k_cache, kd = _quantized((b, s, hkv, d), dtype, device)
    v_cache, vd = _quantized((b, s, hkv, d), dtype, device)
    seqlens = torch.tensor([5, 40, 90], dtype=torch.int32, device=device)
    q = torch.randn(b, 3, h, d, device=device).to(q_dtype)
    k_new, v_new = (torch.randn(b, 3, hkv, d, device=device).to(q_dtype) for _ in range(2))
    kw = dict(cache_seqlens=seqlens, causal=True, num_splits=num_splits, k_descale=kd,
              v_descale=vd, return_lse=True)
    if paged:
        table = torch.randperm(b * s // page, device=device).view(b, s // page).int()
        pool_k, pool_v = (torch.empty(b * s // page, page, hkv, d, dtype=dtype,
                                      device=device) for _ in range(2))
        for pool, cache in ((pool_k, k_cache), (pool_v, v_cache)):
            pool.view(torch.uint8)[table.long()] = cache.view(torch.uint8).view(
                b, s // page, page, hkv, d)
        out, lse = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new,
                                                     block_table=table, **kw)
        k_cache, v_cache = (x.view(torch.uint8)[table.long()].view(dtype).view(b, s, hkv, d)
                            for x in (pool_k, pool_v))
    else:
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    for cache, new, descale in ((k_cache, k_new, kd), (v_cache, v_new, vd)):
        quantised = F8.quantize(new, descale, dtype)[0]
        for i in range(b):
            written = cache[i, seqlens[i]:seqlens[i] + 3]
            assert torch.equal(written.view(torch.uint8), quantised[i].view(torch.uint8))
    p_dtype = torch.float16 if fp8_backend == "triton" else None
    _check_each_sequence(out, lse, q, k_cache, v_cache, (seqlens + 3).tolist(),
                         (None, kd, vd), fp8_backend, dict(causal=True), q_dtype,
                         dtype=p_dtype)


@FP8
def test_kvcache_fp8_queries(dtype, fp8_backend, device, on_gpu):
    """FP8 q over a cache of its format (FP8 new k/v copied as they are); the decode
    kernel computes in fp16."""
    b, s, h, hkv, d = 2, 80, 4, 4, 32
    q, qd = _quantized((b, 2, h, d), dtype, device)
    k_cache, kd = _quantized((b, s, hkv, d), dtype, device)
    v_cache, vd = _quantized((b, s, hkv, d), dtype, device)
    k_new = v_new = k_cache[:, 70:72].clone()
    seqlens = torch.tensor([10, 60], dtype=torch.int32, device=device)
    out_dtype = _out_dtype(on_gpu)
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, q_descale=qd,
        k_descale=kd, v_descale=vd, out_dtype=out_dtype, return_lse=True)
    p_dtype = torch.float16 if fp8_backend == "triton" else None
    for i in range(b):
        n = int(seqlens[i]) + 2
        assert torch.equal(k_cache[i, n - 2:n].view(torch.uint8), k_new[i].view(torch.uint8))
    _check_each_sequence(out, lse, q, k_cache, v_cache, (seqlens + 2).tolist(),
                         (qd, kd, vd), fp8_backend, {}, out_dtype, dtype=p_dtype)


@pytest.mark.parametrize("layout", ["pairs", "odd-dv", "odd-address"])
def test_kvcache_fp8_v_as_column_pairs_or_bytes(layout, fp8_backend, device, on_gpu):
    """An FP8 V is read as int16 words of two columns (V_PAIRS: even and odd columns in
    two products, joined at the end) where its head dim, strides and address are even,
    else byte by byte; both are attention over the dequantised cache."""
    from flashtile.ops import decode

    b, s, h, hkv, d = 2, 70, 4, 2, 32
    dv = 31 if layout == "odd-dv" else 32
    k_cache, kd = _quantized((b, s, hkv, d), E4M3, device)
    v_full, vd = _quantized((b, s, hkv, dv + 1), E4M3, device)
    # odd-address: V a view one byte into rows of 33 (odd strides and address).
    v_cache = v_full[..., 1:] if layout == "odd-address" else v_full[..., :dv].contiguous()
    assert decode.v_pairs(v_cache, False) == (layout == "pairs")
    q = torch.randn(b, 1, h, d, device=device).to(_q_dtype(on_gpu))
    seqlens = torch.tensor([70, 33], dtype=torch.int32, device=device)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 k_descale=kd, v_descale=vd, num_splits=2,
                                                 return_lse=True)
    assert out.shape == (b, 1, h, dv)
    p_dtype = torch.float16 if fp8_backend == "triton" else None
    _check_each_sequence(out, lse, q, k_cache, v_cache, seqlens.tolist(), (None, kd, vd),
                         fp8_backend, {}, q.dtype, dtype=p_dtype)


def _decode_fp8_cache(q, k_cache, v_cache, page, **kw):
    """flash_attn_with_kvcache over the FP8 caches (b, s, hkv, d), or with page a
    page size over a pool holding their pages in a random order."""
    if not page:
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    b, s, hkv = k_cache.shape[:3]
    table = torch.randperm(b * s // page, device=q.device).view(b, s // page).int()
    pools = [torch.empty(b * s // page, page, hkv, x.shape[-1], dtype=x.dtype,
                         device=q.device) for x in (k_cache, v_cache)]
    for pool, cache in zip(pools, (k_cache, v_cache)):
        pool.view(torch.uint8)[table.long()] = cache.view(torch.uint8).view(
            b, s // page, page, hkv, cache.shape[-1])
    return flashtile.flash_attn_with_kvcache(q, *pools, block_table=table, **kw)


# (seqlen_q, nheads, nheads_kv, head_dim, head_dim_v): 4 and 8 query rows a KV head, the
# KEYS_M decode's range; head dims that fill their tiles, and ones that do not.
KEYS_M_HEADS = [pytest.param((1, 8, 2, 32, 32), id="gqa4-d32"),
                pytest.param((2, 4, 1, 24, 30), id="mqa-2-tokens-d24-dv30")]


@pytest.mark.parametrize("keys_m", ["0", "1"], ids=["rows_m", "keys_m"])
@pytest.mark.parametrize("heads", KEYS_M_HEADS)
@pytest.mark.parametrize("page,block_n", [(None, None), (16, None), (16, 32)],
                         ids=["contiguous", "page16", "page16-tile32"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("backend", ["triton"], indirect=True)  # a Triton kernel layout
def test_kvcache_keys_m_layout(keys_m, heads, page, block_n, num_splits, fp8_backend, device,
                               on_gpu, monkeypatch):
    """FLASHTILE_DECODE_FP8_KEYS_M=1 (the default: keys on the products' M side, S^T = K
    Q^T, O^T = V^T P^T) and =0 (query rows on the M side) both give attention over the
    dequantised cache: odd lengths, NaN values past two sequences' ends that must reach
    nothing, a sequence with no keys (out 0, lse -inf), one longer than its cache (NaN
    rows) and one with a NaN key (its KV head's rows NaN). Pages of 16 keys, one a tile
    (the interpreter's 16-key tile) or two (32-key tiles); split and not."""
    from flashtile.ops import configs, decode

    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", keys_m)
    sq, h, hkv, d, dv = heads
    b, s = 5, 64
    k_cache, kd = _quantized((b, s, hkv, d), E4M3, device)
    v_cache, vd = _quantized((b, s, hkv, dv), E4M3, device)
    lens = [37, 0, 61, s + 1, 20]
    for i in (0, 2):  # e4m3 NaN in every value past sequences 0 and 2
        v_cache.view(torch.uint8)[i, lens[i]:] = 0x7F
    k_cache.view(torch.uint8)[4, 7, 0, 3] = 0x7F   # a NaN key inside sequence 4
    q = torch.randn(b, sq, h, d, device=device).to(_q_dtype(on_gpu))
    assert decode.keys_m(q, k_cache, v_cache, False) == (keys_m == "1")
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
              causal=True, num_splits=num_splits, k_descale=kd, v_descale=vd,
              return_lse=True)
    if block_n:
        cfg = configs.decode_config(q, d, sq * h // hkv, keys_m=keys_m == "1")
        monkeypatch.setattr(configs, "_override", dict(configs._override))  # undone after
        configs.set_override("decode", configs.TileConfig(cfg.block_m, block_n))
    out, lse = _decode_fp8_cache(q, k_cache, v_cache, page, **kw)
    p_dtype = torch.float16 if fp8_backend == "triton" else None
    for i in (0, 2):
        n = lens[i]
        _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :n],
               v_cache[i:i + 1, :n], (None, kd[i:i + 1], vd[i:i + 1]), fp8_backend,
               dict(causal=True), q.dtype, dtype=p_dtype)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert torch.isnan(out[3]).all() and torch.isnan(lse[3]).all()
    group = h // hkv
    assert torch.isnan(out[4, :, :group]).all() and torch.isnan(lse[4, :group]).all()
    assert torch.isfinite(out[4, :, group:]).all() and torch.isfinite(lse[4, group:]).all()


@pytest.mark.parametrize("keys_m", ["0", "1"], ids=["rows_m", "keys_m"])
@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_kvcache_keys_m_with_every_score_feature(keys_m, fp8_backend, device, on_gpu,
                                                 monkeypatch):
    """Both decode layouts under a sliding window, softcap and ALiBi together (the
    scores are masked and biased after KEYS_M's products turn back to (rows, keys)), two
    query tokens of 4 heads over one KV head, split."""
    from flashtile.ops import decode

    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", keys_m)
    b, s, h, d = 2, 80, 4, 32
    k_cache, kd = _quantized((b, s, 1, d), E5M2, device)
    v_cache, vd = _quantized((b, s, 1, d), E5M2, device)
    q = torch.randn(b, 2, h, d, device=device).to(_q_dtype(on_gpu))
    assert decode.keys_m(q, k_cache, v_cache, False) == (keys_m == "1")
    lens = [77, 29]
    kw = dict(causal=True, window_size=(23, 0), softcap=4.0,
              alibi_slopes=torch.rand(h, device=device) * 0.3)
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                        device=device),
        k_descale=kd, v_descale=vd, num_splits=3, return_lse=True, **kw)
    p_dtype = torch.float16 if fp8_backend == "triton" else None
    for i, n in enumerate(lens):
        _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :n],
               v_cache[i:i + 1, :n], (None, kd[i:i + 1], vd[i:i + 1]), fp8_backend, kw,
               q.dtype, dtype=p_dtype)


@pytest.mark.parametrize("keys_m", ["0", "1"], ids=["rows_m", "keys_m"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_kvcache_keys_m_with_leftpad(keys_m, page, fp8_backend, device, on_gpu,
                                     monkeypatch):
    """Both decode layouts with cache_leftpad (KEYS_M: unmasked re-reads of the last
    key in a contiguous cache, masked rows where pages are looked up per row): NaN
    values before each sequence's first key and after its last reach nothing."""
    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", keys_m)
    b, s, h, hkv, d = 2, 64, 8, 2, 32
    k_cache, kd = _quantized((b, s, hkv, d), E4M3, device)
    v_cache, vd = _quantized((b, s, hkv, d), E4M3, device)
    pads, lens = [5, 0], [43, 19]
    for i in range(b):
        v_cache.view(torch.uint8)[i, :pads[i]] = 0x7F
        v_cache.view(torch.uint8)[i, lens[i]:] = 0x7F
    q = torch.randn(b, 1, h, d, device=device).to(_q_dtype(on_gpu))
    out, lse = _decode_fp8_cache(
        q, k_cache, v_cache, page, num_splits=2, k_descale=kd, v_descale=vd,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=device),
        return_lse=True)
    p_dtype = torch.float16 if fp8_backend == "triton" else None
    for i in range(b):
        keys = slice(pads[i], lens[i])
        _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, keys],
               v_cache[i:i + 1, keys], (None, kd[i:i + 1], vd[i:i + 1]), fp8_backend, {},
               q.dtype, dtype=p_dtype)


def test_keys_m_switch_is_checked_and_bounded(monkeypatch):
    """A mistyped FLASHTILE_DECODE_FP8_KEYS_M is an error naming the variable; "1" (the
    default) takes the KEYS_M layout only for an FP8 V read as column pairs and at most
    8 query rows per KV head (its N), and then 8-row tiles; "0" the rows-on-M layout."""
    from flashtile.ops import decode

    cache = torch.zeros(1, 16, 2, 32, dtype=torch.uint8).view(E4M3)
    q4, q16 = torch.empty(1, 1, 8, 32), torch.empty(1, 2, 16, 32)
    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_FP8_KEYS_M"):
        decode.keys_m(q4, cache, cache, False)
    monkeypatch.delenv("FLASHTILE_DECODE_FP8_KEYS_M")
    assert decode.keys_m(q4, cache, cache, False)
    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", "1")
    assert decode.keys_m(q4, cache, cache, False)
    assert not decode.keys_m(q16, cache, cache, False)        # 16 rows per KV head
    assert not decode.keys_m(q4, cache, cache[..., :31], False)  # odd V head dim: bytes
    assert not decode.keys_m(q4, cache, cache, True)          # V read from K's tiles
    assert decode._tile(q4, cache, cache, False).block_m == 8
    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", "0")
    assert not decode.keys_m(q4, cache, cache, False)
    assert decode._tile(q4, cache, cache, False).block_m == 16


def test_kvcache_rotary_then_quantised(fp8_backend, device, on_gpu):
    """Rotary embedding turns the 16-bit new keys before they are quantised."""
    b, s, hkv, d = 2, 32, 2, 16
    k_cache, v_cache = (torch.zeros(b, s, hkv, d, dtype=torch.uint8, device=device).view(E4M3)
                        for _ in range(2))
    q = torch.randn(b, 1, hkv, d, device=device, dtype=_q_dtype(on_gpu))
    k, v = (torch.randn(b, 1, hkv, d, device=device, dtype=q.dtype) for _ in range(2))
    cos, sin = torch.rand(s, 4, device=device), torch.rand(s, 4, device=device)
    kd = torch.full((b, hkv), 0.25, device=device)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                      rotary_sin=sin, cache_seqlens=3, k_descale=kd)
    from flashtile.inference import apply_rotary
    rotated = apply_rotary(k, cos, sin, torch.full((b, 1), 3, device=device), True)
    assert torch.equal(k_cache[:, 3].view(torch.uint8),
                       F8.quantize(rotated, kd, E4M3)[0][:, 0].view(torch.uint8))


# ---- quantize: the definition the append kernel matches ----

def test_quantize_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([500.0, -1e6, float("inf"), float("nan"), 0.0, 15.9, 17.0, 1e-4])
    x = x.view(1, -1, 1, 1)
    ones = torch.ones(())
    e4m3 = F8.quantize(x, ones, E4M3)[0].float().flatten().tolist()
    assert e4m3[:3] == [448.0, -448.0, 448.0]
    assert math.isnan(e4m3[3]) and e4m3[4] == 0.0
    assert e4m3[5:7] == [16.0, 16.0]      # 17 is a tie between 16 and 18: even
    assert e4m3[7] == 0.0                  # below half the smallest subnormal 2**-9
    e5m2 = F8.quantize(x, ones, E5M2)[0].float().flatten().tolist()
    assert e5m2[:3] == [512.0, -57344.0, 57344.0]  # saturated, never inf
    xd, descale = F8.quantize(torch.randn(2, 5, 3, 8) * 100)
    assert descale.shape == (2, 3) and xd.float().abs().max() <= 448


def test_quantize_default_scales_per_kv_group():
    x = torch.randn(2, 5, 6, 8)
    x[1, :, 4:6] *= 1000
    _, descale = F8.quantize(x, nheads_kv=3)
    expected = x.abs().unflatten(2, (3, 2)).amax(dim=(1, 3, 4)) / 448
    torch.testing.assert_close(descale, expected)


# ---- bad input: each error names the argument ----

def _fp8_qkv(dtype=E4M3, device="cpu"):
    return _dense_inputs(2, 8, 8, 4, 2, 16, dtype, device)[0]


@pytest.mark.parametrize("change, error, message", [
    pytest.param(lambda q, k, v: dict(k=k.to(torch.float32).to(E5M2)), TypeError,
                 "k.dtype: expected q's dtype torch.float8_e4m3fn, got torch.float8_e5m2",
                 id="mixed-formats"),
    pytest.param(lambda q, k, v: dict(q_descale=torch.ones(2, 4)), ValueError,
                 "q_descale.shape: expected (2, 2) (batch, nheads_kv)", id="shape"),
    pytest.param(lambda q, k, v: dict(k_descale=torch.ones(3, 1)), ValueError,
                 "k_descale.shape: expected (2, 2)", id="shape-batch"),
    pytest.param(lambda q, k, v: dict(v_descale=torch.ones(2, 2, 1)), ValueError,
                 "v_descale.shape", id="shape-rank"),
    pytest.param(lambda q, k, v: dict(k_descale=torch.ones(2, 2, dtype=torch.float16)),
                 TypeError, "k_descale.dtype: expected torch.float32", id="dtype"),
    pytest.param(lambda q, k, v: dict(v_descale=torch.ones(2, 2, device="meta")),
                 ValueError, "v_descale.device: expected q's device cpu", id="device"),
    pytest.param(lambda q, k, v: dict(q_descale=0.5), TypeError,
                 "q_descale: expected a float32 torch.Tensor", id="python-float"),
    pytest.param(lambda q, k, v: dict(out_dtype=E4M3), TypeError,
                 "out_dtype: expected torch.bfloat16, torch.float16 or torch.float32",
                 id="out-dtype-fp8"),
    pytest.param(lambda q, k, v: dict(q=q.float().requires_grad_().to(E4M3)),
                 NotImplementedError, "q requires grad, but FP8 attention is forward only",
                 id="grad-q"),
    pytest.param(lambda q, k, v: dict(k_descale=torch.ones(2, 2, requires_grad=True)),
                 NotImplementedError, "k_descale requires grad", id="grad-descale"),
    pytest.param(lambda q, k, v: dict(zip("qkv", (torch.zeros(*x.shape[:-1], 320).to(E4M3)
                                                  for x in (q, k, v)))), ValueError,
                 "q.shape[-1] (head_dim): expected 1 to 256 for float8 inputs",
                 id="head-dim-over-256"),
])
def test_flash_attn_func_rejects(change, error, message):
    q, k, v = _fp8_qkv()
    args = dict(q=q, k=k, v=v)
    args.update(change(q, k, v))
    with pytest.raises(error, match=_escape(message)):
        flashtile.flash_attn_func(**args)


def _escape(message):
    import re
    return re.escape(message)


def test_grad_error_names_the_dtype():
    q, k, v = _fp8_qkv(E5M2)
    with pytest.raises(NotImplementedError, match="v.dtype is torch.float8_e5m2"):
        flashtile.flash_attn_func(q, k, v.requires_grad_())


def test_descales_only_for_fp8(backend, device):
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16, device=device)
               for _ in range(3))
    with pytest.raises(ValueError, match=r"q_descale: expected None with torch\.float16 q"):
        flashtile.flash_attn_func(q, k, v, q_descale=torch.ones(1, 2, device=device))
    with pytest.raises(ValueError, match=r"out_dtype: expected None or q's dtype"):
        flashtile.flash_attn_func(q, k, v, out_dtype=torch.float32)
    assert flashtile.flash_attn_func(q, k, v, out_dtype=torch.float16).dtype == torch.float16


def test_varlen_rejects_bad_descale():
    q, k, v = (x[0] for x in _fp8_qkv())
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k_descale\.shape: expected \(2, 2\)"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, k_descale=torch.ones(3, 2))


@pytest.mark.parametrize("change, error, message", [
    pytest.param(dict(q=torch.float32), TypeError,
                 "k_cache.dtype: expected q's dtype torch.float32, or with float16 or "
                 "bfloat16 q a float8 cache", id="fp32-q"),
    pytest.param(dict(v_cache=E5M2), TypeError, "v_cache.dtype", id="mixed-cache-formats"),
    pytest.param(dict(q=E5M2), TypeError, "k_cache.dtype: expected q's dtype "
                 "torch.float8_e5m2", id="fp8-q-other-format"),
    pytest.param(dict(q_descale=True), ValueError,
                 "q_descale: expected None with q in torch.bfloat16", id="q-descale-bf16"),
    pytest.param(dict(k_cache=torch.bfloat16, v_cache=torch.bfloat16, k_descale=True),
                 ValueError, "k_descale: expected None with k_cache in torch.bfloat16",
                 id="k-descale-bf16-cache"),
    pytest.param(dict(k_descale="wrong-shape"), ValueError, "k_descale.shape",
                 id="k-descale-shape"),
    pytest.param(dict(q=E4M3, rotary=True), ValueError, "rotary_cos: expected None with "
                 "torch.float8_e4m3fn q", id="rotary-fp8-q"),
    pytest.param(dict(new=torch.float16), TypeError, "k.dtype/device", id="new-k-dtype"),
])
def test_kvcache_rejects(change, error, message):
    dtypes = dict(q=torch.bfloat16, k_cache=E4M3, v_cache=E4M3, new=None)
    dtypes.update({k: v for k, v in change.items() if k in dtypes})
    q = torch.randn(2, 1, 4, 16).to(dtypes["q"])
    caches = [torch.zeros(2, 32, 2, 16).to(dtypes[n]) for n in ("k_cache", "v_cache")]
    kw = dict(cache_seqlens=3)
    if change.get("q_descale"):
        kw["q_descale"] = torch.ones(2, 2)
    if change.get("k_descale") is True:
        kw["k_descale"] = torch.ones(2, 2)
    elif change.get("k_descale"):
        kw["k_descale"] = torch.ones(3, 2)
    if change.get("rotary"):
        kw.update(rotary_cos=torch.ones(32, 4), rotary_sin=torch.zeros(32, 4))
    if change.get("new"):
        kw.update(k=torch.randn(2, 1, 2, 16).to(change["new"]),
                  v=torch.randn(2, 1, 2, 16).to(change["new"]))
    with pytest.raises(error, match=_escape(message)):
        flashtile.flash_attn_with_kvcache(q, *caches, **kw)


def test_fp8_refused_where_not_supported():
    q, k, v = _fp8_qkv()
    with pytest.raises(TypeError, match="query: expected dtype float16, bfloat16 or float32"):
        flashtile.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                               enable_gqa=True)
    with pytest.raises(TypeError, match="qkv: expected dtype float16, bfloat16 or float32"):
        flashtile.flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the interpreter's own FP8 conversions (TRITON_INTERPRET=1)")
def test_interpreter_without_fixed_conversions_refuses_fp8(monkeypatch):
    """Triton 3.6's interpreter rounds to FP8 wrongly; unless that is fixed, FP8 on its
    path is a TypeError naming the dtype, not wrong numbers."""
    from flashtile.ops._fp8 import interpreter_converts_fp8

    if interpreter_converts_fp8():
        pytest.skip("this Triton's interpreter converts to FP8 correctly")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    q, k, v = _fp8_qkv()
    message = (r"\.dtype: expected no float8 dtype while the Triton kernels run in this "
               r"Triton's interpreter")
    with pytest.raises(TypeError, match="q" + message):
        flashtile.flash_attn_func(q, k, v)
    # An FP8 cache under fp16 queries: refused before the append writes it.
    cache = torch.zeros(2, 16, 2, 16, dtype=torch.uint8).view(E4M3)
    q16, k16 = (torch.randn(2, 1, 2, 16, dtype=torch.float16) for _ in range(2))
    with pytest.raises(TypeError, match="k_cache" + message):
        flashtile.flash_attn_with_kvcache(q16, cache, cache.clone(), k16, k16,
                                          cache_seqlens=3)
    assert not cache.view(torch.uint8).any()


# ---- torch.compile and the custom op ----

def test_opcheck_and_compile(fp8_backend, device):
    (q, k, v), descales = _dense_inputs(1, 12, 20, 4, 2, 16, E4M3, device)
    args = (q, k, v, *descales, None, None, 0, 0, None, None, None, 0.25, 8, -1, 0, 0.0,
            torch.float16)
    # test_schema compares inputs with a multiply that CPU FP8 tensors do not have.
    torch.library.opcheck(F8.fp8_attn_fwd, args, test_utils=("test_faketensor",))
    fn = torch.compile(flashtile.flash_attn_func, fullgraph=True)
    kw = dict(causal=True, q_descale=descales[0], k_descale=descales[1],
              v_descale=descales[2])
    torch.testing.assert_close(fn(q, k, v, **kw), flashtile.flash_attn_func(q, k, v, **kw))


def test_fp8_pool_under_16bit_queries_compiles(fp8_backend, device, on_gpu):
    """flash_attn_varlen_func over an FP8 pool with 16-bit q (an engine's prefill over an
    FP8 KV cache) under torch.compile(fullgraph=True): the same output as eager."""
    page, hkv, d = 16, 2, 32
    pool_k, pool_v = (torch.randn(6, page, hkv, d, device=device).to(E4M3) for _ in range(2))
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=device)
    q = torch.randn(9, 4, d, device=device).to(_q_dtype(on_gpu))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    used = torch.tensor([30, 41], dtype=torch.int32, device=device)
    kd = torch.tensor(0.5, device=device)
    kw = dict(causal=True, block_table=table, seqused_k=used, k_descale=kd, v_descale=kd)
    fn = torch.compile(flashtile.flash_attn_varlen_func, fullgraph=True)
    torch.testing.assert_close(fn(q, pool_k, pool_v, cu_q, None, 5, 48, **kw),
                               flashtile.flash_attn_varlen_func(q, pool_k, pool_v, cu_q,
                                                                None, 5, 48, **kw))


# ---- GPU: the H200 shapes ----

@pytest.mark.gpu
@FP8
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 1024, 16, 16, 128), (1, 4096, 8, 2, 128),
                                   (1, 2048, 8, 8, 64), (1, 1000, 4, 4, 256)],
                         ids=lambda s: "b{}-s{}-h{}/{}-d{}".format(*s))
def test_gpu_forward(shape, causal, dtype, device):
    b, s, h, hkv, d = shape
    (q, k, v), descales = _dense_inputs(b, s, s, h, hkv, d, dtype, device)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, return_lse=True,
                                         q_descale=descales[0], k_descale=descales[1],
                                         v_descale=descales[2])
    _check(out, lse, q, k, v, descales, "triton", dict(causal=causal), torch.bfloat16)


# ---- the benchmarks: FP8 providers and bytes ----

def test_bench_fp8_providers_agree(fp8_backend, device):
    """flashtile-fp8 (dense, V^T copy) and flashtile-fp8-varlen (V as it is) time the
    same attention: their builds give equal outputs on one input set."""
    from flashtile.bench import registry
    from flashtile.bench.run import make_inputs

    cell = registry.Cell("flashtile-fp8", 32, True, "fwd", 48, 2, 2, torch.float32)
    inputs = make_inputs(cell, "bshd", device)[0]
    outs = []
    for name in ("flashtile-fp8", "flashtile-fp8-varlen"):
        provider = registry.PROVIDERS[name]
        assert provider.modes == ("fwd",) and name not in registry.ALL
        q, k, v, _ = provider.prepare(*inputs)
        assert q[0].dtype == E4M3 and q[1].shape == (2, 2)
        outs.append(provider.build(cell, device)(q, k, v).view(2, 48, 2, 32))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-2)


def test_decode_table_counts_fp8_bytes():
    from flashtile.bench.decode import decode_markdown, kv_bytes, provider_bytes

    assert provider_bytes("flashtile-fp8-paged64", 8, 4096) == kv_bytes(8, 4096) // 2
    rows = [dict(batch=1, seqlen_k=8192, cache_gb=0.03, copies=6,
                 flashtile=dict(us=12.0, gbps=2800.0),
                 **{"flashtile-fp8": dict(us=5.0, gbps=3600.0),
                    "sdpa-flash": dict(us=20.0, gbps=1600.0)})]
    text = decode_markdown(rows, copy_gbps=4000.0)
    header, rule, row = text.splitlines()[:3]
    assert "flashtile-fp8 % of copy" in header and header.count("|") == rule.count("|")
    assert "| 70% | 90% | 1.75 |" in row


def test_decode_bench_fp8_providers_match_their_reference(backend, device, on_gpu):
    """The decode table's FP8 caches (contiguous and paged) give attention over the
    cache's e4m3 values, the check run_decode_bench makes before timing them."""
    if backend == "triton" and not on_gpu:
        pytest.skip("bf16 queries: not in the interpreter")
    from flashtile.bench import decode

    refs, providers = decode._providers(2, 128, device)
    for name in ("flashtile-fp8", "flashtile-fp8-paged64"):
        out = providers[name]()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), refs["fp8"].float(), rtol=0, atol=2e-2)
    # copy-fp8: K's FP8 bytes into a buffer of their own, read plus written as many
    # bytes as the FP8 providers read.
    copied = providers["copy-fp8"]()
    assert copied.dtype == torch.uint8 and copied.numel() == 2 * 128 * decode.NHEADS_KV \
        * decode.HEAD_DIM
    assert 2 * copied.numel() == decode.provider_bytes("copy-fp8", 2, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("keys_m", ["0", "1"], ids=["rows_m", "keys_m"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_decode_long_fp8_cache(paged, keys_m, device, monkeypatch, request):
    """The decode table's shape: bf16 queries over an 8k-token e4m3 cache, split; in
    both of the kernel's layouts (FLASHTILE_DECODE_FP8_KEYS_M: there with sm_90's
    paired cvts on V^T's words)."""
    from flashtile.ops import _launch

    monkeypatch.setenv("FLASHTILE_DECODE_FP8_KEYS_M", keys_m)
    _launch.clear()  # plans keep the layout they were made with: none from before,
    request.addfinalizer(_launch.clear)  # and none of this one's after
    b, s, h, hkv, d, page = 4, 8192, 32, 8, 128, 64
    k_cache, kd = _quantized((b, s, hkv, d), E4M3, device)
    v_cache, vd = _quantized((b, s, hkv, d), E4M3, device)
    q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16)
    seqlens = torch.tensor([8192, 4097, 100, 6000], dtype=torch.int32, device=device)
    out, lse = _decode_fp8_cache(q, k_cache, v_cache, page if paged else None,
                                 cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                 return_lse=True)
    _check_each_sequence(out, lse, q, k_cache, v_cache, seqlens.tolist(), (None, kd, vd),
                         "triton", {}, torch.bfloat16, dtype=torch.float16)


@pytest.mark.gpu
def test_gpu_decode_bf16_rows_of_any_magnitude(device):
    """bf16 query rows reach the fp16 products of the FP8-cache decode each scaled by
    its own power of two (ops/_fp8._fp16_rows): rows far outside fp16's range (1e-30,
    1e30 before the softmax scale makes them sharp), a zero row and ordinary ones."""
    b, s, h, hkv, d = 2, 1000, 8, 2, 128
    k_cache, kd = _quantized((b, s, hkv, d), E4M3, device)
    v_cache, vd = _quantized((b, s, hkv, d), E4M3, device)
    q = torch.randn(b, 1, h, d, device=device)
    q = q * torch.tensor([1e-30, 1e-6, 0.0, 1.0, 3.0, 1e-2, 1e4, 1e-38],
                         device=device)[:, None]
    q = q.to(torch.bfloat16)
    seqlens = torch.tensor([1000, 517], dtype=torch.int32, device=device)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 k_descale=kd, v_descale=vd, return_lse=True)
    _check_each_sequence(out, lse, q, k_cache, v_cache, seqlens.tolist(), (None, kd, vd),
                         "triton", {}, torch.bfloat16, dtype=torch.float16)


@pytest.mark.gpu
def test_gpu_launch_plans_take_new_descales(device):
    """A second call with the same shapes goes through the cached launch plans
    (ops/_launch.py): new descale tensors must reach the kernels (their pointers are
    per-call slots), in the forward, the append and the decode."""
    from flashtile.ops import _launch

    (q, k, v), descales = _dense_inputs(2, 256, 256, 8, 2, 128, E4M3, device)
    k_cache, v_cache = (torch.randn(2, 512, 2, 128, device=device).to(E4M3)
                        for _ in range(2))
    q16 = torch.randn(2, 1, 8, 128, device=device, dtype=torch.bfloat16)
    k_new = torch.randn(2, 1, 2, 128, device=device, dtype=torch.bfloat16)

    def calls(scales):
        caches = [x.clone() for x in (k_cache, v_cache)]
        out = flashtile.flash_attn_func(q, k, v, causal=True, q_descale=scales[0],
                                        k_descale=scales[1], v_descale=scales[2])
        dec = flashtile.flash_attn_with_kvcache(q16, *caches, k_new, k_new,
                                                cache_seqlens=300, k_descale=scales[1],
                                                v_descale=scales[2])
        return out, dec, *(x.view(torch.uint8) for x in caches)

    calls(descales)  # makes the plans
    doubled = [x * 2 for x in descales]
    planned = calls(doubled)
    previous = _launch.set_enabled(False)
    try:
        expected = calls(doubled)
    finally:
        _launch.set_enabled(previous)
    for a, b in zip(planned, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@triton.jit
def _rows_kernel(X, Y, S, M: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    y, _, scale = _fp16_rows(tl.load(X + offs), 0, False)
    tl.store(Y + offs, y)
    tl.store(S + tl.arange(0, M)[:, None], scale)


def test_bf16_rows_scale_into_fp16_exactly(on_gpu):
    """_fp16_rows (the FP8-cache decode's q): each row times a power of two that puts
    its largest magnitude in [2**14, 2**15), so every bf16 value down to 2**-31 of the
    largest is exact in fp16 and the rest are off by at most 2**-39 of it; zero, inf
    and NaN rows keep their values. Run on bf16-representable fp32 rows (the
    interpreter's bf16 is not numpy's), through the interpreter or the GPU."""
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a Triton kernel: GPU or TRITON_INTERPRET=1")
    device = "cuda" if on_gpu else "cpu"
    magnitudes = [2e-39, 1e-30, 1e-6, 0.0, 1.0, 1e4, 1e37, float("inf")]
    x = torch.randn(8, 32, dtype=torch.float64) * torch.tensor(magnitudes,
                                                              dtype=torch.float64)[:, None]
    x[:, 0] = x[:, 0].abs() * 2  # rows' largest, so rows also hold values 2**-40 below it
    x[:, 1] = x[:, 0] * 2.0**-40
    x[7, 3] = float("nan")
    x = x.to(torch.bfloat16).float().to(device)
    y = torch.empty(x.shape, dtype=torch.float16, device=device)
    scale = torch.empty(8, 1, dtype=torch.float32, device=device)
    _rows_kernel[(1,)](x, y, scale, M=8, D=32)
    x, y, scale = x.double().cpu(), y.double().cpu(), scale.double().cpu()
    finite = torch.isfinite(x).all(1) & (x.abs().amax(1) > 0)
    # A row of fp32 subnormals (row 0) needs more than the largest power of two,
    # 2**127: its values, 8 significant bits at most, are exact all the same.
    normal = finite & (x.abs().amax(1) >= 2.0**-126)
    largest = (x.abs().amax(1, keepdim=True) * scale)[normal]
    assert normal.sum() == 5 and ((largest >= 2**14) & (largest < 2**15)).all()
    assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale))))  # powers of two
    back = y / scale
    exact = x.abs() >= x.abs().amax(1, keepdim=True) * 2.0**-31
    assert torch.equal(back[finite][exact[finite]], x[finite][exact[finite]])
    err = (back - x).abs()[finite]
    assert (err <= x.abs().amax(1, keepdim=True)[finite] * 2.0**-39).all()
    assert torch.equal(y[3], torch.zeros(32, dtype=torch.float64))  # the zero row
    assert torch.isinf(y[7, 0]) and torch.isnan(y[7, 3])
