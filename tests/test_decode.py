"""flash_attn_with_kvcache: decode equals full attention; paged equals contiguous; splits."""

import os

import pytest
import torch

import flashtile
from flashtile.inference import apply_rotary
from flashtile.ops import configs
from flashtile.reference import attention_naive


def _dtype(on_gpu):
    return torch.bfloat16 if on_gpu else torch.float32


def _tol(on_gpu):
    return dict(rtol=2e-2, atol=2e-2) if on_gpu else dict(rtol=1e-5, atol=1e-5)


def _cache(b, s, hkv, d, device, dtype):
    return (torch.randn(b, s, hkv, d, device=device, dtype=dtype),
            torch.randn(b, s, hkv, d, device=device, dtype=dtype))


def _paged(k_cache, v_cache, page_size, gen):
    """The same tokens in a pool of pages, allocated in a random order."""
    b, s, hkv, d = k_cache.shape
    per_seq = s // page_size
    perm = torch.randperm(b * per_seq + 3, generator=gen)[: b * per_seq]
    block_table = perm.view(b, per_seq).to(torch.int32).to(k_cache.device)
    pool_k = torch.randn(b * per_seq + 3, page_size, hkv, d, dtype=k_cache.dtype,
                         device=k_cache.device)
    pool_v = torch.randn_like(pool_k)
    for i in range(b):
        for j in range(per_seq):
            blk = block_table[i, j]
            pool_k[blk] = k_cache[i, j * page_size:(j + 1) * page_size]
            pool_v[blk] = v_cache[i, j * page_size:(j + 1) * page_size]
    return pool_k, pool_v, block_table


@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_decode_equals_full_attention(seqlen_q, causal, heads, backend, device, on_gpu):
    h, hkv = heads
    b, s, d = 3, 96, 32
    dtype = _dtype(on_gpu)
    k_cache, v_cache = _cache(b, s, hkv, d, device, dtype)
    seqlens = torch.tensor([1 + seqlen_q, 45, 96], dtype=torch.int32, device=device)
    q = torch.randn(b, seqlen_q, h, d, device=device, dtype=dtype)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 causal=causal, return_lse=True)
    for i in range(b):
        L = int(seqlens[i])
        ref, ref_lse = flashtile.flash_attn_func(q[i:i + 1], k_cache[i:i + 1, :L],
                                                 v_cache[i:i + 1, :L], causal=causal,
                                                 return_lse=True)
        torch.testing.assert_close(out[i:i + 1], ref, **_tol(on_gpu))
        torch.testing.assert_close(lse[i:i + 1], ref_lse, rtol=1e-4, atol=1e-4)


@pytest.fixture(params=[None, 64], ids=["default_tile", "tile_n64"])
def decode_tile(request, backend, on_gpu):
    """None: the table's tile; 64: keys per tile above the page size, so a tile spans
    several whole pages (one lookup per page), or, under a left pad, looks up each
    row's page. The interpreter's table tile has 16 keys, so 64 is the other layout
    there; the torch backend has no tiles, and the GPU table's tile already has 64 keys
    (only its pipeline depth would differ), so those cases would repeat default_tile."""
    if request.param is not None and (backend == "torch" or on_gpu):
        pytest.skip("the same tile layout as default_tile")
    if request.param is not None:
        configs.set_override("decode", configs.TileConfig(16, request.param, 4, 2))
    yield request.param
    configs.set_override("decode", None)


@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_paged_equals_contiguous(page_size, leftpad, decode_tile, backend, device, on_gpu):
    """Page sizes below, equal to and above the key tile (several pages per tile, one
    page per tile); a left pad shifts tiles off the page boundaries (per-row lookup)."""
    b, s, h, hkv, d = 2, 128, 4, 2, 16
    dtype = _dtype(on_gpu)
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(b, s, hkv, d, device, dtype)
    pool_k, pool_v, block_table = _paged(k_cache, v_cache, page_size, gen)
    seqlens = torch.tensor([77, 128], dtype=torch.int32, device=device)
    q = torch.randn(b, 2, h, d, device=device, dtype=dtype)
    kw = dict(cache_seqlens=seqlens, causal=True, window_size=(40, 0), softcap=5.0,
              alibi_slopes=torch.rand(h, device=device))
    if leftpad:
        kw["cache_leftpad"] = torch.tensor([5, 0], dtype=torch.int32, device=device)
    ref = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    out = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, block_table=block_table, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5 if not on_gpu else 1e-2,
                               atol=1e-5 if not on_gpu else 1e-2)


def test_num_splits_agree(device, on_gpu, monkeypatch):
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton kernels")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    b, s, h, hkv, d = 2, 160, 4, 1, 16
    dtype = _dtype(on_gpu)
    k_cache, v_cache = _cache(b, s, hkv, d, device, dtype)
    seqlens = torch.tensor([13, 160], dtype=torch.int32, device=device)
    q = torch.randn(b, 1, h, d, device=device, dtype=dtype)
    base, base_lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                       cache_seqlens=seqlens, num_splits=1,
                                                       return_lse=True)
    for n in range(2, 17):
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                     cache_seqlens=seqlens, num_splits=n,
                                                     return_lse=True)
        torch.testing.assert_close(out, base, **_tol(on_gpu))
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_list", ["preloaded", "per_tile"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_splits_equal_contiguous(page_size, leftpad, page_list, decode_tile, backend,
                                       device, on_gpu, monkeypatch):
    """Split counts from 2 to 16 over a paged cache (pages below, at and above the key
    tile; shifted off the page boundaries by a left pad) equal the unsplit contiguous
    cache: each split starts its page lookups at its own first key. A short split loads
    its page list before its K/V loop and gathers each tile's pages from it
    ("preloaded"); a split over more than decode.MAX_SPLIT_PAGES pages looks pages up a
    tile ahead ("per_tile", forced here by a limit of 0)."""
    if backend == "torch":
        pytest.skip("splits are a Triton kernel's")
    from flashtile.ops import decode
    if page_list == "per_tile":
        monkeypatch.setattr(decode, "MAX_SPLIT_PAGES", 0)
    b, s, h, hkv, d = 2, 192, 4, 2, 16
    dtype = _dtype(on_gpu)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _cache(b, s, hkv, d, device, dtype)
    pool_k, pool_v, block_table = _paged(k_cache, v_cache, page_size, gen)
    kw = dict(cache_seqlens=torch.tensor([101, 192], dtype=torch.int32, device=device),
              causal=True, return_lse=True)
    if leftpad:
        kw["cache_leftpad"] = torch.tensor([7, 0], dtype=torch.int32, device=device)
    q = torch.randn(b, 1, h, d, device=device, dtype=dtype)
    ref, ref_lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1, **kw)
    for n in (2, 3, 7, 16):
        out, lse = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, block_table=block_table,
                                                     num_splits=n, **kw)
        torch.testing.assert_close(out, ref, **_tol(on_gpu))
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "late", "0"], ids=["pdl", "pdl_late", "no_pdl"])
def test_split_decode_replays_in_cuda_graph(pdl, device, monkeypatch):
    """Serving replays decode as a CUDA graph. On Hopper the split path's combine kernel
    is a programmatic dependent launch (scheduled before the decode grid ends, it waits
    for it): captured and replayed with new queries, two steps back to back, the split
    result must still equal the unsplit one, signalled early, late, or not dependent."""
    monkeypatch.setenv("FLASHTILE_DECODE_PDL", pdl)
    b, s, h, hkv, d = 1, 4099, 32, 8, 128
    k_cache, v_cache = _cache(b, s, hkv, d, device, torch.bfloat16)
    seqlens = torch.tensor([4001], dtype=torch.int32, device=device)
    q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16)

    def step():
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 num_splits=0, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # a decode right behind a combine, as in a step loop
        out, lse = step()
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        base, base_lse = flashtile.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=1, return_lse=True)
        torch.testing.assert_close(out, base, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)


def test_append_writes_cache_and_rotary(backend, device, on_gpu):
    b, s, h, hkv, d, n = 2, 64, 4, 2, 32, 3
    dtype = _dtype(on_gpu)
    k_cache, v_cache = _cache(b, s, hkv, d, device, dtype)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    q = torch.randn(b, n, h, d, device=device, dtype=dtype)
    k_new = torch.randn(b, n, hkv, d, device=device, dtype=dtype)
    v_new = torch.randn(b, n, hkv, d, device=device, dtype=dtype)
    cos = torch.randn(80, 8, device=device).cos()
    sin = torch.randn(80, 8, device=device).sin()
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                            rotary_cos=cos, rotary_sin=sin,
                                            cache_seqlens=seqlens, causal=True,
                                            rotary_interleaved=False)
    pos = seqlens.long()[:, None] + torch.arange(n, device=device)
    k_rot = apply_rotary(k_new, cos, sin, pos, interleaved=False)
    q_rot = apply_rotary(q, cos, sin, pos, interleaved=False)
    for i in range(b):
        L = int(seqlens[i])
        k_copy[i, L:L + n] = k_rot[i]
        v_copy[i, L:L + n] = v_new[i]
    torch.testing.assert_close(k_cache, k_copy, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_copy, rtol=0, atol=0)
    ref = flashtile.flash_attn_with_kvcache(q_rot, k_copy, v_copy,
                                            cache_seqlens=seqlens + n, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _rotary_ref(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb at integer positions (b, s), in float64: the first
    rotary_dim dims rotated as complex pairs, (x0, x1) pairs (GPT-J) or halves (NeoX)."""
    rd = cos.shape[1] * 2
    angle = torch.complex(cos.double(), sin.double())[positions][:, :, None, :]
    xr = x[..., :rd].double()
    if interleaved:
        z = torch.view_as_complex(xr.unflatten(-1, (rd // 2, 2)).contiguous()) * angle
        rot = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(xr[..., :rd // 2], xr[..., rd // 2:]) * angle
        rot = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rot, x[..., rd:].double()), dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_leftpad_rotary_positions_are_absolute(causal, interleaved, backend, device,
                                               on_gpu):
    """Regression (issue 13, item 11): with cache_leftpad, flash-attn rotates the new keys
    at their cache positions cache_seqlens[b] + i (and q there, or at cache_seqlens[b]
    when neither causal nor local), as its tests' reference does; flashtile rotated them
    at cache_seqlens[b] - cache_leftpad[b] + i. Checked: the cache written and the
    output, against a float64 rotation and the float64 oracle."""
    b, s, h, hkv, d, n = 2, 48, 4, 2, 32, 3
    dtype = _dtype(on_gpu)
    k_cache, v_cache = _cache(b, s, hkv, d, device, dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([20, 9], dtype=torch.int32, device=device)
    leftpad = torch.tensor([7, 0], dtype=torch.int32, device=device)
    q = torch.randn(b, n, h, d, device=device, dtype=dtype)
    k_new, v_new = (torch.randn(b, n, hkv, d, device=device, dtype=dtype) for _ in "kv")
    angle = torch.rand(s, 8, device=device) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    out = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=seqlens, cache_leftpad=leftpad, causal=causal,
        rotary_interleaved=interleaved)

    pos = seqlens.long()[:, None] + torch.arange(n, device=device)   # absolute positions
    k_rot = _rotary_ref(k_new, cos, sin, pos, interleaved)
    q_rot = _rotary_ref(q, cos, sin, pos if causal else pos[:, :1].expand(b, n),
                        interleaved)
    for i in range(b):
        L = int(seqlens[i])
        want_k[i, L:L + n], want_v[i, L:L + n] = k_rot[i].to(dtype), v_new[i]
    tol = dict(rtol=2e-2, atol=2e-2) if on_gpu else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache, want_k, **tol)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)
    for i in range(b):
        p, L = int(leftpad[i]), int(seqlens[i]) + n
        ref, _ = attention_naive(q_rot[i:i + 1], want_k[i:i + 1, p:L].double(),
                                 want_v[i:i + 1, p:L].double(), causal=causal)
        torch.testing.assert_close(out[i:i + 1], ref.to(dtype), **_tol(on_gpu))


def test_rotary_table_needs_only_the_rows_it_reads(device, index_checks):
    """Regression: rotary_cos needs max(cache_seqlens) + the rows used past it, and a
    non-causal q sits at one position (cache_seqlens[b]), so 4 queries with 1 new key at
    position 15 read rows 15 only: a 16-row table is enough (flashtile asked for 19, and
    flash-attn's own tests, whose table is the cache length, hit that). Causal queries
    sit at 15..18 and do need 19 rows."""
    q = torch.randn(1, 4, 2, 16, device=device)
    k_cache, v_cache = (torch.zeros(1, 16, 2, 16, device=device) for _ in "kv")
    k_new, v_new = (torch.randn(1, 1, 2, 16, device=device) for _ in "kv")
    cos, sin = (torch.rand(16, 8, device=device) for _ in "cs")
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=15)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    with pytest.raises(ValueError, match=r"rotary_cos.shape\[0\]: expected >= 19 positions"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, causal=True,
                                          **kw)


def test_batch_idx_and_leftpad(backend, device, on_gpu):
    b, s, h, hkv, d = 2, 64, 2, 2, 16
    dtype = _dtype(on_gpu)
    k_cache, v_cache = _cache(4, s, hkv, d, device, dtype)
    q = torch.randn(b, 1, h, d, device=device, dtype=dtype)
    idx = torch.tensor([3, 1], dtype=torch.int32, device=device)
    pad = torch.tensor([4, 0], dtype=torch.int32, device=device)
    seqlens = torch.tensor([30, 17], dtype=torch.int32, device=device)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            cache_batch_idx=idx, cache_leftpad=pad)
    for i in range(b):
        r, p, L = int(idx[i]), int(pad[i]), int(seqlens[i])
        ref = flashtile.flash_attn_func(q[i:i + 1], k_cache[r:r + 1, p:L],
                                        v_cache[r:r + 1, p:L])
        torch.testing.assert_close(out[i:i + 1], ref, **_tol(on_gpu))


def test_kvcache_errors(device, index_checks):
    q = torch.randn(2, 1, 4, 16, device=device)
    kc, vc = torch.randn(2, 32, 2, 16, device=device), torch.randn(2, 32, 2, 16, device=device)
    sl = torch.tensor([3, 40], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl)
    k_new = torch.randn(2, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k_new, k_new, cache_seqlens=30)
    with pytest.raises(ValueError, match="nheads_kv"):
        flashtile.flash_attn_with_kvcache(q, kc[:, :, :1].expand(2, 32, 3, 16).contiguous(),
                                          vc[:, :, :1].expand(2, 32, 3, 16).contiguous(),
                                          cache_seqlens=3)
    pool = torch.randn(6, 16, 2, 16, device=device)
    bt = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_table"):
        flashtile.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=20, block_table=bt)
    pool24 = torch.randn(6, 24, 2, 16, device=device)
    with pytest.raises(ValueError, match="page_size"):
        flashtile.flash_attn_with_kvcache(q, pool24, pool24, cache_seqlens=20,
                                          block_table=bt.clamp(max=5))
    with pytest.raises(TypeError, match="cache_seqlens.dtype"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl.long())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_batch_zero(paged, backend, device):
    """Regression: an empty batch gives empty outputs; the index check's aminmax over no
    cache_seqlens used to raise a RuntimeError."""
    q = torch.randn(0, 1, 4, 16, device=device)
    cache = torch.randn(0 if not paged else 2, 16, 2, 16, device=device)
    table = torch.zeros(0, 1, dtype=torch.int32, device=device) if paged else None
    out, lse = flashtile.flash_attn_with_kvcache(
        q, cache, cache, cache_seqlens=torch.zeros(0, dtype=torch.int32, device=device),
        block_table=table, return_lse=True)
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)


def test_large_pool_is_not_refused():
    """A paged KV pool past 2**31 elements is normal in serving: the decode kernel
    addresses pages with 64-bit offsets, so validation lets it through; a contiguous
    cache that large is refused (its row offsets are 32-bit). Meta: no memory."""
    from flashtile.inference import _check_cache

    pool = torch.empty(2**16, 64, 8, 128, device="meta")  # 2**32 elements
    q = torch.empty(2, 1, 32, 128, device="meta")
    seqlens = torch.empty(2, dtype=torch.int32, device="meta")
    table = torch.empty(2, 4, dtype=torch.int32, device="meta")
    assert _check_cache(q, pool, pool, None, None, table, seqlens, None, None) == 0
    contiguous = torch.empty(2, 2**26, 8, 8, device="meta")
    with pytest.raises(ValueError, match="32-bit offsets"):
        _check_cache(q[..., :8], contiguous, contiguous, None, None, None, seqlens, None,
                     None)


def test_strided_index_tensors(backend, device):
    """Regression: cache_seqlens / block_table views with non-unit strides are read as
    their values, not as the memory after their first element."""
    b, s, hkv, d = 2, 64, 2, 16
    k_cache, v_cache = _cache(b, s, hkv, d, device, torch.float32)
    pool_k, pool_v, block_table = _paged(k_cache, v_cache, 16, torch.Generator().manual_seed(3))
    q = torch.randn(b, 1, 4, d, device=device)
    seqlens = torch.tensor([[40, -1], [64, -1]], dtype=torch.int32, device=device)[:, 0]
    wide = torch.cat([block_table, torch.full_like(block_table, 10**6)], dim=1)
    strided_table = wide.t().contiguous().t()[:, : block_table.shape[1]]  # column stride b
    assert seqlens.stride(0) == 2 and strided_table.stride(1) != 1
    out = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens,
                                            block_table=strided_table)
    ref = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                            cache_seqlens=seqlens.contiguous())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_grid_limit_is_a_clear_error(device):
    q = torch.randn(2049, 1, 32, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="batch \\* nheads"):
        flashtile.flash_attn_func(q, q, q)


def test_paged_kv_cache_pool_feeds_the_kernel(backend, device, on_gpu):
    """flashtile.kv_cache.PagedKVCache -> plan() -> flash_attn_with_kvcache equals dense
    attention over each sequence's tokens, including a forked sequence that shares its
    prefix pages (copy-on-write on its first append)."""
    from flashtile.kv_cache import PagedKVCache

    dtype = _dtype(on_gpu)
    h, hkv, d, page = 4, 2, 16, 16
    cache = PagedKVCache(num_blocks=24, page_size=page, num_layers=1, nheads_kv=hkv,
                         head_dim=d, dtype=dtype, device=device)
    tokens = {}
    for seq, n in (("a", 37), ("b", 5)):
        cache.add_sequence(seq)
        k = torch.randn(1, n, hkv, d, device=device, dtype=dtype)
        v = torch.randn(1, n, hkv, d, device=device, dtype=dtype)
        cache.append(seq, k, v)
        tokens[seq] = (k[0], v[0])
    cache.fork("a", "c")
    k = torch.randn(1, 3, hkv, d, device=device, dtype=dtype)
    v = torch.randn(1, 3, hkv, d, device=device, dtype=dtype)
    cache.append("c", k, v)
    tokens["c"] = (torch.cat([tokens["a"][0], k[0]]), torch.cat([tokens["a"][1], v[0]]))

    seqs = ["a", "b", "c"]
    plan = cache.plan(seqs)
    q = torch.randn(len(seqs), 1, h, d, device=device, dtype=dtype)
    out = flashtile.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0],
                                            cache_seqlens=plan.cache_seqlens,
                                            block_table=plan.block_table, causal=True)
    for i, seq in enumerate(seqs):
        kb, vb = tokens[seq]
        ref = flashtile.flash_attn_func(q[i:i + 1], kb[None], vb[None], causal=True)
        torch.testing.assert_close(out[i:i + 1], ref, **_tol(on_gpu))


@pytest.mark.parametrize("work_items,seqlen_k,expected", [
    (8, 8192, 33),      # batch 1, 8 KV heads: 264 programs on 132 SMs
    (64, 8192, 4),      # batch 8: 256 programs (5 splits put a third on 56 SMs)
    (64, 32768, 4),
    (100, 8192, 2),
    (132, 8192, 1),     # the grid fills the GPU without splitting
    (8, 300, 3),        # at least two 64-key blocks per split
    (1, 10**7, 128),    # capped
])
def test_num_splits_heuristic(work_items, seqlen_k, expected):
    from flashtile.ops.decode import num_splits_heuristic

    assert num_splits_heuristic(work_items, seqlen_k, 64, num_sms=132) == expected


def test_pdl_switch_is_checked(monkeypatch):
    """A mistyped FLASHTILE_DECODE_PDL is an error naming the variable, not silently on;
    off CUDA (or before Hopper) nothing is a dependent launch."""
    from flashtile.ops.combine import combine_pdl

    q = torch.empty(1, 1, 1, 16)
    monkeypatch.setenv("FLASHTILE_DECODE_PDL", "off")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_PDL"):
        combine_pdl(q)
    for mode in ("0", "1", "late", " Late "):
        monkeypatch.setenv("FLASHTILE_DECODE_PDL", mode)
        assert combine_pdl(q) == (False, False)
