"""flash_attn_varlen_func with a block_table: packed new queries over keys in a paged KV
pool (an engine's prefill after a prefix-cache hit, or one chunk of a long prompt),
against a float64 oracle on the same keys laid out contiguously."""

import pytest
import torch

import flashtile
from flashtile import interface
from flashtile.reference import attention_naive
from tests.utils import assert_close_rule

H, HKV, D = 4, 2, 40  # GQA, and a head_dim the kernel pads (EVEN_D False)


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _paged_batch(lens_k, page_size, dtype, device, gen, spare_columns=1):
    """Each sequence's keys/values (L_b, HKV, D) and the same tokens scattered into a pool
    in a shuffled page order. The block table has spare columns, and padding entries
    that name other sequences' blocks (allowed: only the first ceil(L_b / page_size)
    entries of a row are read)."""
    pages = [-(-n // page_size) for n in lens_k]
    num_blocks = sum(pages) + 3
    width = max(pages, default=0) + spare_columns
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lens_k), width), generator=gen)
    pool_k = torch.randn(num_blocks, page_size, HKV, D, generator=gen)
    pool_v = torch.randn(num_blocks, page_size, HKV, D, generator=gen)
    keys, values, used = [], [], 0
    for b, n in enumerate(lens_k):
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        keys.append(k)
        values.append(v)
        table[b, :pages[b]] = order[used:used + pages[b]]
        used += pages[b]
        for p in range(pages[b]):
            rows = slice(p * page_size, min((p + 1) * page_size, n))
            pool_k[table[b, p], : rows.stop - rows.start] = k[rows]
            pool_v[table[b, p], : rows.stop - rows.start] = v[rows]
    to = dict(dtype=dtype, device=device)
    return (pool_k.to(**to), pool_v.to(**to), table.to(torch.int32).to(device),
            [k.to(**to) for k in keys], [v.to(**to) for v in values])


# (new queries per sequence, keys per sequence: earlier tokens plus the new ones, kwargs)
CASES = {
    # A chunk of n new tokens at the end of L keys; an empty sequence; a sequence with
    # keys but no new query; a full prefill (n = L); a decode-like step (n = 1); more
    # queries than keys (the first rows see no key under causal: out 0, lse -inf).
    "chunked_causal": ([5, 0, 0, 37, 1, 13, 7], [40, 0, 9, 37, 1, 100, 3],
                       dict(causal=True)),
    "window": ([17, 31, 2], [23, 90, 11], dict(window_size=(16, 3))),
    "full": ([19, 4], [41, 130], dict()),
    "alibi_softcap": ([11, 29, 6], [29, 75, 6], dict(causal=True, softcap=3.0,
                                                      alibi="per_sequence")),
    "alibi_shared_window_causal": ([9, 20], [61, 20], dict(causal=True, window_size=(8, 0),
                                                           alibi="shared")),
}


def _run_case(case, page_size, dtype, device, on_gpu, seqused=False):
    lens_q, lens_k, kw = CASES[case]
    kw = dict(kw)
    if on_gpu:  # longer sequences cross more tiles and pages at the GPU's tile sizes
        lens_q = [x * 7 for x in lens_q]
        lens_k = [x * 7 for x in lens_k]
    gen = torch.Generator().manual_seed(len(lens_q) * 1000 + page_size)
    pool_k, pool_v, table, keys, values = _paged_batch(lens_k, page_size, dtype, device,
                                                       gen)
    q = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype=dtype, device=device)
    alibi = kw.pop("alibi", None)
    if alibi == "per_sequence":
        kw["alibi_slopes"] = torch.rand(len(lens_q), H, generator=gen).to(device)
    elif alibi == "shared":
        kw["alibi_slopes"] = torch.rand(H, generator=gen).to(device)
    cu_q = _cu(lens_q, device)
    lengths = dict(seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=device)) \
        if seqused else {}
    with torch.no_grad():
        out, lse = flashtile.flash_attn_varlen_func(
            q, pool_k, pool_v, cu_q, None if seqused else _cu(lens_k, device), max(lens_q),
            max(lens_k), return_lse=True, block_table=table, **lengths, **kw)
    return out, lse, (q, keys, values, lens_q, kw)


def _check_against_oracle(out, lse, inputs):
    q, keys, values, lens_q, kw = inputs
    starts = _cu(lens_q, "cpu").tolist()
    for b, (qs, qe) in enumerate(zip(starts, starts[1:])):
        if qe == qs:
            continue
        kw_b = dict(kw)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kw_b["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        args = (q[None, qs:qe], keys[b][None], values[b][None])
        ref64, lse64 = attention_naive(*args, **kw_b)                # float64, bottom-right
        ref_same, lse_same = attention_naive(*args, upcast=False, **kw_b)  # torch, our dtype
        assert_close_rule(f"seq {b} out", out[qs:qe], ref64[0], ref_same[0])
        lse_b, lse64, lse_same = lse[:, qs:qe], lse64[0], lse_same[0]
        assert torch.equal(torch.isinf(lse_b), torch.isinf(lse64)), f"seq {b}: empty rows"
        finite = torch.isfinite(lse64)
        assert_close_rule(f"seq {b} lse", lse_b[finite], lse64[finite], lse_same[finite])


def _dtypes(on_gpu):
    return (torch.float16, torch.bfloat16) if on_gpu else (torch.float32, torch.float16)


@pytest.mark.parametrize("dtype_index", [0, 1], ids=["fp32_or_fp16", "fp16_or_bf16"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_varlen_matches_oracle(case, page_size, dtype_index, backend, device, on_gpu):
    """Pages of 16 keys are smaller than the interpreter's key tile (one lookup per row);
    64 and 256 hold whole tiles (one lookup per tile). Shuffled pools and padded block
    tables; fp32 and fp16 on CPU, fp16 and bf16 on the GPU."""
    dtype = _dtypes(on_gpu)[dtype_index]
    out, lse, inputs = _run_case(case, page_size, dtype, device, on_gpu)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check_against_oracle(out, lse, inputs)


@pytest.mark.parametrize("page_size", [16, 64])
def test_seqused_k_equals_cu_seqlens_k(page_size, backend, device, on_gpu):
    """seqused_k (vLLM's argument) gives each sequence's key count directly: the same
    result as cu_seqlens_k, bit for bit."""
    dtype = _dtypes(on_gpu)[0]
    out, lse, _ = _run_case("chunked_causal", page_size, dtype, device, on_gpu)
    out_s, lse_s, _ = _run_case("chunked_causal", page_size, dtype, device, on_gpu,
                                seqused=True)
    torch.testing.assert_close(out_s, out, rtol=0, atol=0)
    torch.testing.assert_close(lse_s, lse, rtol=0, atol=0)


def test_chunked_prefill_equals_whole_prompt(backend, device, on_gpu):
    """An engine's chunked prefill: a prompt whose keys are all in the pool, attended in
    three chunks of new queries (each over the keys up to its end), equals the whole
    prompt's causal prefill, row for row."""
    dtype = _dtypes(on_gpu)[0]
    n = 150 if not on_gpu else 1500
    chunks = [0, 41, 90, n]
    gen = torch.Generator().manual_seed(7)
    pool_k, pool_v, table, _, _ = _paged_batch([n], 16, dtype, device, gen)
    q = torch.randn(n, H, D, generator=gen).to(dtype=dtype, device=device)
    with torch.no_grad():
        whole = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, _cu([n], device),
                                                 _cu([n], device), n, n, causal=True,
                                                 block_table=table)
        # The three chunks as one batch of three sequences sharing the prompt's pages.
        lens_q = [b - a for a, b in zip(chunks, chunks[1:])]
        parts = flashtile.flash_attn_varlen_func(
            q, pool_k, pool_v, _cu(lens_q, device), None, max(lens_q), n, causal=True,
            block_table=table.expand(3, -1).contiguous(),
            seqused_k=torch.tensor(chunks[1:], dtype=torch.int32, device=device))
    tol = dict(rtol=0, atol=2e-2) if on_gpu else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts, whole, **tol)


def test_paged_equals_packed_varlen(backend, device, on_gpu):
    """The same keys paged or packed back to back give the same answer."""
    dtype = _dtypes(on_gpu)[0]
    lens_q, lens_k = [5, 0, 33], [40, 3, 70]
    gen = torch.Generator().manual_seed(11)
    pool_k, pool_v, table, keys, values = _paged_batch(lens_k, 16, dtype, device, gen)
    q = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype=dtype, device=device)
    args = (_cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k))
    with torch.no_grad():
        paged = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, *args, causal=True,
                                                 block_table=table)
        packed = flashtile.flash_attn_varlen_func(q, torch.cat(keys), torch.cat(values),
                                                  *args, causal=True)
    tol = dict(rtol=0, atol=2e-2) if on_gpu else dict(rtol=0, atol=0)
    torch.testing.assert_close(paged, packed, **tol)


def test_empty_batch(backend, device):
    """batch 0 (cu_seqlens_q = [0]) with an empty block table: empty outputs."""
    q = torch.randn(0, H, D, device=device)
    pool = torch.randn(2, 16, HKV, D, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    out, lse = flashtile.flash_attn_varlen_func(
        q, pool, pool, zero, zero, 0, 0, causal=True, return_lse=True,
        block_table=torch.zeros(0, 1, dtype=torch.int32, device=device))
    assert out.shape == (0, H, D) and lse.shape == (H, 0)


# ---- bad input ----

def _good(device):
    gen = torch.Generator().manual_seed(0)
    pool_k, pool_v, table, _, _ = _paged_batch([20, 33], 16, torch.float32, device, gen)
    q = torch.randn(9, H, D, device=device)
    return dict(q=q, k=pool_k, v=pool_v, cu_seqlens_q=_cu([4, 5], device),
                cu_seqlens_k=_cu([20, 33], device), max_seqlen_q=5, max_seqlen_k=33,
                block_table=table)


def _with(device, **changes):
    args = _good(device)
    args.update(changes)
    return args


def _bad_table(device, **kw):
    return _good(device)["block_table"].clone().index_put_(
        (torch.tensor([1]), torch.tensor([0])), torch.tensor(kw["value"], dtype=torch.int32))


BAD = {
    "table_int64": (lambda d: _with(d, block_table=_good(d)["block_table"].long()),
                    TypeError, "block_table.dtype: expected torch.int32"),
    "table_rows": (lambda d: _with(d, block_table=_good(d)["block_table"][:1]),
                   ValueError, r"block_table.shape: expected \(2, "),
    "table_1d": (lambda d: _with(d, block_table=_good(d)["block_table"][0]),
                 ValueError, "block_table: expected an int32 tensor"),
    "table_past_pool": (lambda d: _with(d, block_table=_bad_table(d, value=_good(d)["k"]
                                                                  .shape[0])),
                        ValueError, "block_table: expected block indices in"),
    "table_negative": (lambda d: _with(d, block_table=_bad_table(d, value=-1)),
                       ValueError, "block_table: expected block indices in"),
    "keys_past_table": (lambda d: _with(d, cu_seqlens_k=_cu([20, 65], d), max_seqlen_k=64),
                        ValueError, r"cu_seqlens_k\[b \+ 1\] - cu_seqlens_k\[b\] \(the key "
                        r"lengths\): expected values in \[0, 64\]"),
    "keys_negative": (lambda d: _with(d, cu_seqlens_k=torch.tensor([0, 20, 7],
                                                                   dtype=torch.int32,
                                                                   device=d)),
                      ValueError, "the key lengths"),
    "seqused_past_table": (lambda d: _with(d, cu_seqlens_k=None, seqused_k=torch.tensor(
                               [20, 65], dtype=torch.int32, device=d)),
                           ValueError, r"seqused_k: expected values in \[0, 64\]"),
    "seqused_int64": (lambda d: _with(d, seqused_k=torch.tensor([20, 33], device=d)),
                      TypeError, "seqused_k.dtype"),
    "seqused_shape": (lambda d: _with(d, seqused_k=torch.tensor([20, 33, 1],
                                                                dtype=torch.int32,
                                                                device=d)),
                      ValueError, "seqused_k.shape"),
    "no_key_lengths": (lambda d: _with(d, cu_seqlens_k=None),
                       ValueError, "cu_seqlens_k/seqused_k: expected one of them"),
    "cu_q_total": (lambda d: _with(d, cu_seqlens_q=_cu([4, 4], d)),
                   ValueError, "cu_seqlens_q: expected non-decreasing prefix sums"),
    "cu_q_int64": (lambda d: _with(d, cu_seqlens_q=_cu([4, 5], d).long()),
                   TypeError, "cu_seqlens_q.dtype"),
    "max_seqlen_q": (lambda d: _with(d, max_seqlen_q=4),
                     ValueError, "max_seqlen_q: expected >= the longest sequence 5"),
    "max_seqlen_k_past_table": (lambda d: _with(d, max_seqlen_k=65),
                                ValueError, "max_seqlen_k: expected at most"),
    "max_seqlen_k_float": (lambda d: _with(d, max_seqlen_k=33.0),
                           TypeError, "max_seqlen_k: expected an int"),
    "page_size_24": (lambda d: _with(d, k=torch.randn(6, 24, HKV, D, device=d),
                                     v=torch.randn(6, 24, HKV, D, device=d)),
                     ValueError, r"k.shape\[1\] \(page_size\): expected a power of two"),
    "page_size_8": (lambda d: _with(d, k=torch.randn(6, 8, HKV, D, device=d),
                                    v=torch.randn(6, 8, HKV, D, device=d)),
                    ValueError, r"page_size\): expected a power of two from 16 to 256"),
    "packed_k": (lambda d: _with(d, k=torch.randn(53, HKV, D, device=d),
                                 v=torch.randn(53, HKV, D, device=d)),
                 ValueError, r"k: expected a paged cache \(num_blocks, page_size"),
    "v_shape": (lambda d: _with(d, v=_good(d)["v"][:-1]), ValueError, "v.shape"),
    "k_dtype": (lambda d: _with(d, k=_good(d)["k"].half()), TypeError, "k.dtype"),
    "empty_pool": (lambda d: _with(d, k=torch.randn(0, 16, HKV, D, device=d),
                                   v=torch.randn(0, 16, HKV, D, device=d)),
                   ValueError, "num_blocks"),
    "head_dim": (lambda d: _with(d, k=torch.randn(6, 16, HKV, 32, device=d),
                                 v=torch.randn(6, 16, HKV, 32, device=d)),
                 ValueError, "head_dim"),
}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after_good_calls"])
@pytest.mark.parametrize("case", list(BAD))
def test_paged_varlen_rejects(case, warm, device, index_checks, monkeypatch, on_gpu):
    """Also after good calls with the same layouts (whose checks are remembered per
    layout, issue 15), every time."""
    if not on_gpu:  # the good calls' numbers are not the point: the quick backend
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    interface._check_paged_varlen_layouts.cache_clear()
    make, error, message = BAD[case]
    for _ in range(2):
        with torch.no_grad():
            if warm:
                flashtile.flash_attn_varlen_func(**_good(device))
            with pytest.raises(error, match=message):
                flashtile.flash_attn_varlen_func(**make(device))


def test_seqused_k_needs_block_table(device):
    args = _good(device)
    args.pop("block_table")
    q, k = torch.randn(9, H, D, device=device), torch.randn(53, HKV, D, device=device)
    args.update(q=q, k=k, v=k, seqused_k=torch.tensor([20, 33], dtype=torch.int32,
                                                        device=device))
    with pytest.raises(ValueError, match="seqused_k: expected None without block_table"):
        flashtile.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_grad_with_block_table_is_refused(which, device):
    """Forward only, as flash-attn: asking for gradients is an error before any work,
    and the same call under torch.no_grad() runs."""
    args = _good(device)
    args[which] = args[which].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="block_table is forward only"):
        flashtile.flash_attn_varlen_func(**args)
    with torch.no_grad():
        flashtile.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("entry", ["eager_function", "op"])
def test_direct_op_backward_with_block_table_raises(entry, device):
    """The custom op itself (or its eager twin), called with grad-requiring inputs and a
    block table, raises in backward instead of returning gradients of the wrong
    tensors."""
    from flashtile import custom_ops

    call = custom_ops.varlen_attention if entry == "eager_function" \
        else custom_ops.varlen_attn_fwd
    a = _good(device)
    q = a["q"].clone().requires_grad_()
    out, _ = call(q, a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 33, None,
                  0.25, -1, 0, 0.0, False, a["block_table"], None)
    with pytest.raises(NotImplementedError, match="forward only"):
        out.sum().backward()


def test_large_pool_is_not_refused():
    """A pool past 2**31 elements is normal in serving: pages are addressed with 64-bit
    offsets, so validation lets it through (meta tensors: no memory, and the op's fake
    implementation gives the shapes)."""
    pool = torch.empty(2**16, 64, 8, 128, device="meta")  # 2**32 elements
    q = torch.empty(10, 32, 128, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    table = torch.empty(2, 4, dtype=torch.int32, device="meta")
    out, lse = flashtile.flash_attn_varlen_func(q, pool, pool, cu, cu, 5, 256, causal=True,
                                                block_table=table, return_lse=True)
    assert out.shape == (10, 32, 128) and lse.shape == (32, 10)
