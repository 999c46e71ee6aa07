"""flash_attn_with_kvcache and paged varlen with v's head dim its own (issue 17 item 2):
MLA's 192/128, an odd pair with dv > d, and DeepSeek's absorbed decode, 576/512 over one
latent cache shared by every query head (v_cache a view of k_cache's first 512 columns).
Contiguous and paged, split and unsplit, appended tokens, GQA/MQA; against float64."""

import logging

import pytest
import torch

import flashtile
from flashtile.inference import apply_rotary
from flashtile.ops import configs, decode
from flashtile.reference import attention_naive
from tests.conftest import triton_available_here
from tests.utils import assert_close_rule

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
# (d, dv, nheads, nheads_kv, shared): shared = v_cache is k_cache[..., :dv].
CASES = [pytest.param(192, 128, 4, 2, False, id="d192-dv128-gqa"),
         pytest.param(24, 40, 4, 2, False, id="d24-dv40-gqa"),
         pytest.param(576, 512, 8, 1, True, id="d576-dv512-shared-mqa"),
         # Both pad to one 64-wide tile: V read from K's tiles, columns 40..47 unstored.
         pytest.param(48, 40, 3, 1, True, id="d48-dv40-shared-mqa")]
# (paged, num_splits)
LAYOUTS = [pytest.param(False, 1, id="contiguous"), pytest.param(False, 3, id="contiguous-split3"),
           pytest.param(True, 1, id="paged"), pytest.param(True, 3, id="paged-split3")]
PAGE_SIZE = 16


def _caches(b, s, hkv, d, dv, shared, dtype, device):
    """k_cache (b, s, hkv, d) and v_cache (b, s, hkv, dv), the latter a view of the
    former's first dv columns when shared (absorbed MLA's latent cache)."""
    k_cache = torch.randn(b, s, hkv, d, dtype=dtype, device=device)
    if shared:
        return k_cache, k_cache[..., :dv]
    return k_cache, torch.randn(b, s, hkv, dv, dtype=dtype, device=device)


def _pool(k_cache, v_cache, shared, page_size=PAGE_SIZE):
    """The same rows in a pool of page_size pages in random order (v a view of k's
    when shared, as in the contiguous caches), and the block table."""
    b, s, hkv, d = k_cache.shape
    per_seq, n_blocks = s // page_size, b * s // page_size + 3  # 3 blocks nobody uses
    gen = torch.Generator().manual_seed(3)
    block_table = torch.randperm(n_blocks, generator=gen)[:b * per_seq].view(b, per_seq)
    pool_k, pool_v = _caches(n_blocks, page_size, hkv, d, v_cache.shape[-1], shared,
                             k_cache.dtype, k_cache.device)
    for i in range(b):
        for j in range(per_seq):
            rows = slice(j * page_size, (j + 1) * page_size)
            pool_k[block_table[i, j]] = k_cache[i, rows]
            if not shared:
                pool_v[block_table[i, j]] = v_cache[i, rows]
    return pool_k, pool_v, block_table.to(torch.int32).to(k_cache.device)


def _attend(q, k_cache, v_cache, paged, shared, page_size=PAGE_SIZE, **kw):
    """flash_attn_with_kvcache over the caches, or over a pool of their pages:
    (out, lse, the caches' rows afterwards as (b, s, hkv, d) tensors)."""
    if not paged:
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True,
                                                     **kw)
        return out, lse, k_cache, v_cache
    pool_k, pool_v, table = _pool(k_cache, v_cache, shared, page_size)
    out, lse = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table,
                                                 return_lse=True, **kw)
    k_rows, v_rows = (pool[table.long()].flatten(1, 2) for pool in (pool_k, pool_v))
    return out, lse, k_rows, v_rows


def _check(out, lse, q, k_cache, v_cache, seqlens, causal):
    """out/lse of each sequence against float64, by the accuracy rule."""
    assert out.shape == (*q.shape[:3], v_cache.shape[-1])
    for i, n in enumerate(seqlens.tolist()):
        qkv = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
        o64, l64 = attention_naive(*(x.double() for x in qkv), causal=causal)
        o_pt, _ = attention_naive(*qkv, causal=causal, upcast=False)
        assert_close_rule(f"out[{i}]", out[i:i + 1], o64, o_pt)
        torch.testing.assert_close(lse[i:i + 1].double(), l64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("paged, num_splits", LAYOUTS)
@pytest.mark.parametrize("d, dv, h, hkv, shared", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_value_head_dim(backend, dtype, d, dv, h, hkv, shared, paged, num_splits,
                                device):
    """Two query tokens (causal), an odd and a full sequence of a 48-key cache."""
    b, s = 2, 48
    k_cache, v_cache = _caches(b, s, hkv, d, dv, shared, dtype, device)
    q = torch.randn(b, 2, h, d, dtype=dtype, device=device)
    seqlens = torch.tensor([19, 48], dtype=torch.int32, device=device)
    out, lse, _, _ = _attend(q, k_cache, v_cache, paged, shared, cache_seqlens=seqlens,
                             causal=True, num_splits=num_splits)
    _check(out, lse, q, k_cache, v_cache, seqlens, causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["batch_idx", "paged"])
def test_shared_latent_with_every_feature(backend, paged, device):
    """576/512 over shared rows with a left pad (per-row page lookup when paged) or a
    cache_batch_idx, a window, softcap and ALiBi, three queries, split in three."""
    dtype, b, s, h = torch.float16, 2, 48, 4
    k_cache, v_cache = _caches(3, s, 1, 576, 512, True, dtype, device)
    q = torch.randn(b, 3, h, 576, dtype=dtype, device=device)
    seqlens = torch.tensor([30, 48], dtype=torch.int32, device=device)
    feats = dict(causal=True, window_size=(20, 0), softcap=4.0,
                 alibi_slopes=torch.rand(h, device=device))
    kw = dict(cache_seqlens=seqlens, num_splits=3, return_lse=True, **feats)
    if paged:
        leftpad = torch.tensor([5, 0], dtype=torch.int32, device=device)
        pool_k, pool_v, table = _pool(k_cache[:b], v_cache[:b], True)
        out, lse = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table,
                                                     cache_leftpad=leftpad, **kw)
        rows = [slice(int(leftpad[i]), int(seqlens[i])) for i in range(b)]
        cache_rows = [0, 1]
    else:
        cache_rows = [2, 0]
        batch_idx = torch.tensor(cache_rows, dtype=torch.int32, device=device)
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                     cache_batch_idx=batch_idx, **kw)
        rows = [slice(0, int(n)) for n in seqlens]
    for i in range(b):
        qkv = (q[i:i + 1], k_cache[cache_rows[i]][None, rows[i]],
               v_cache[cache_rows[i]][None, rows[i]])
        o64, l64 = attention_naive(*(x.double() for x in qkv), **feats)
        o_pt, _ = attention_naive(*qkv, upcast=False, **feats)
        assert_close_rule(f"out[{i}]", out[i:i + 1], o64, o_pt)
        torch.testing.assert_close(lse[i:i + 1].double(), l64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d, dv", [pytest.param(192, 128, id="d192-dv128"),
                                   pytest.param(24, 40, id="d24-dv40")])
def test_append_value_head_dim(backend, d, dv, paged, device):
    """New k (rotated) and v of their own head dims written into the caches, then
    attended: the cache rows hold them, and out is the reference over the new caches."""
    b, s, h, hkv, sn, dtype = 2, 48, 4, 2, 3, torch.float16
    k_cache, v_cache = _caches(b, s, hkv, d, dv, False, dtype, device)
    q = torch.randn(b, sn, h, d, dtype=dtype, device=device)
    k = torch.randn(b, sn, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, sn, hkv, dv, dtype=dtype, device=device)
    start = torch.tensor([7, 40], dtype=torch.int32, device=device)
    angles = torch.rand(s, 8, device=device) * 6
    rotary = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    out, lse, k_cache, v_cache = _attend(q, k_cache, v_cache, paged, False, k=k, v=v,
                                         cache_seqlens=start, causal=True, num_splits=2,
                                         **rotary)
    pos = start.long()[:, None] + torch.arange(sn, device=device)
    k_rot, q_rot = (apply_rotary(x, rotary["rotary_cos"], rotary["rotary_sin"], pos, True)
                    for x in (k, q))
    for i in range(b):
        rows = slice(int(start[i]), int(start[i]) + sn)
        torch.testing.assert_close(k_cache[i, rows], k_rot[i], rtol=0, atol=0)
        torch.testing.assert_close(v_cache[i, rows], v[i], rtol=0, atol=0)
    _check(out, lse, q_rot, k_cache, v_cache, start + sn, causal=True)


def test_shared_latent_is_read_from_k_tiles(caplog, device, monkeypatch, on_gpu):
    """Absorbed MLA's V, a view of K's rows, is taken from the K tiles (V_IS_K: the
    cache read once), and gives what a V of its own storage gives, bit for bit."""
    if not triton_available_here(on_gpu):
        pytest.skip("needs the Triton kernels")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    k_cache, v_cache = _caches(2, 32, 1, 576, 512, True, torch.float32, device)
    q = torch.randn(2, 1, 4, 576, dtype=torch.float32, device=device)
    seqlens = torch.tensor([9, 32], dtype=torch.int32, device=device)
    configs._seen_variants.clear()
    with caplog.at_level(logging.INFO, logger="flashtile"):
        shared = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert "V_IS_K" in caplog.text
    own = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache.clone(),
                                            cache_seqlens=seqlens)
    assert torch.equal(shared, own)


@pytest.fixture
def dv_parts_tile(request):
    """The decode tile with V's columns in two programs (configs.TileConfig.dv_parts,
    the GPU's tile past 64 rows at 576/512), forced: the CPU picks one part. 16 rows a
    block, so 24 query rows make two row blocks of two parts each."""
    configs.set_override("decode", configs.TileConfig(16, 16, 4, 2, dv_parts=2))
    yield
    configs.set_override("decode", None)


@pytest.mark.parametrize("paged, num_splits", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_v_columns_in_two_programs(dtype, paged, num_splits, dv_parts_tile, device,
                                   on_gpu, monkeypatch):
    """Absorbed MLA (576/512, V K's first 512 columns) with each program owning 256 of
    V's columns and adding K's other 256 and its 64 rope columns to the scores: out and
    lse against float64, three query tokens of 8 heads over one KV head (24 rows, two
    row blocks), causal, an odd and a full sequence."""
    if not triton_available_here(on_gpu):
        pytest.skip("needs the Triton kernels")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    b, s, h = 2, 48, 8
    k_cache, v_cache = _caches(b, s, 1, 576, 512, True, dtype, device)
    q = torch.randn(b, 3, h, 576, dtype=dtype, device=device)
    seqlens = torch.tensor([19, 48], dtype=torch.int32, device=device)
    out, lse, _, _ = _attend(q, k_cache, v_cache, paged, True, cache_seqlens=seqlens,
                             causal=True, num_splits=num_splits)
    _check(out, lse, q, k_cache, v_cache, seqlens, causal=True)


def test_v_columns_in_two_programs_need_v_from_k(dv_parts_tile, device, on_gpu,
                                                 monkeypatch):
    """dv_parts > 1 (FLASHTILE_DECODE_CONFIG's fifth value) where V is not read from
    K's tiles (a V of its own storage): a ValueError naming it, not a wrong result."""
    if not triton_available_here(on_gpu):
        pytest.skip("needs the Triton kernels")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    k_cache, v_cache = _caches(1, 32, 1, 576, 512, False, torch.float32, device)
    q = torch.randn(1, 1, 4, 576, dtype=torch.float32, device=device)
    seqlens = torch.tensor([32], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"decode tile dv_parts: expected 1 unless "
                                         r"v_cache is k_cache's first columns.*got 2"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)


@pytest.mark.parametrize("heads, tile, splits", [
    (16, configs.TileConfig(16, 32, 8, 3), 64),           # 2 programs an SM: as before
    (64, configs.TileConfig(64, 32, 8, 3), 32),
    (128, configs.TileConfig(128, 32, 8, 2, dv_parts=2), 16)])
def test_absorbed_tiles_by_heads(heads, tile, splits):
    """The GPU's 16-bit tile by query rows at 576/512 with V K's first columns
    (configs._wide_key_decode_config), and the split count of batch 4 x 8k keys on 132
    SMs: the wgmma tiles fill shared memory, so one program an SM, not two (128 heads:
    V in two parts, two programs per split and sequence)."""
    q = torch.empty(4, 1, heads, 576, dtype=torch.bfloat16, device="meta")
    cfg = configs.decode_config(q, 576, heads, head_dim_v=512, v_is_k=True)
    assert cfg == tile
    programs = 4 * decode._row_programs(q, 1, cfg)
    assert programs == (8 if heads == 128 else 4)
    assert decode.split_plan(programs, 8192, cfg.block_n, 64, 0, 132, False,
                             configs.decode_programs_per_sm(576, cfg))[0] == splits


def test_decode_config_env_takes_dv_parts(monkeypatch):
    """FLASHTILE_DECODE_CONFIG's fifth value is dv_parts; other kinds take four."""
    monkeypatch.setenv("FLASHTILE_DECODE_CONFIG", "128,32,8,2,2")
    q = torch.empty(1, dtype=torch.bfloat16, device="meta")
    assert configs.decode_config(q, 576, 128) == configs.TileConfig(128, 32, 8, 2, 2)
    monkeypatch.setenv("FLASHTILE_FWD_CONFIG", "64,64,4,2,2")
    with pytest.raises(ValueError, match=r"FLASHTILE_FWD_CONFIG must be 'BLOCK_M,BLOCK_N"
                                         r"\[,num_warps\[,num_stages\]\]' of integers, "
                                         r"got '64,64,4,2,2'"):
        configs.fwd_config(q, 64)


def test_hopper_mla_decode_config_env(monkeypatch):
    """FLASHTILE_HOPPER_MLA_DECODE_CONFIG picks the Gluon kernel's keys a tile and ring
    depth; its rows and warps are the kernel's, and fewer than 3 stages are refused.
    FLASHTILE_DECODE_MLA names a kernel or is refused."""
    assert configs.hopper_mla_decode_config() == configs.HOPPER_MLA_DECODE
    monkeypatch.setenv("FLASHTILE_HOPPER_MLA_DECODE_CONFIG", "64,32,4,3")
    assert configs.hopper_mla_decode_config() == configs.TileConfig(64, 32, 4, 3)
    for bad in ("128,32,4,4", "64,32,8,4", "64,48,4,4", "64,32,4,2"):
        monkeypatch.setenv("FLASHTILE_HOPPER_MLA_DECODE_CONFIG", bad)
        with pytest.raises(ValueError, match="'64,BLOCK_N,4,STAGES'"):
            configs.hopper_mla_decode_config()
    least = configs.DECODE_MLA_GLUON_MIN_KEYS
    assert configs.decode_mla_kernel(1, least) == "gluon"  # auto, the default
    assert configs.decode_mla_kernel(4, least // 4) == "gluon"
    assert configs.decode_mla_kernel(1, least - 1) == "triton"
    assert configs.decode_mla_kernel(3, least // 4) == "triton"
    for forced in ("gluon", "triton"):
        monkeypatch.setenv("FLASHTILE_DECODE_MLA", forced)
        assert configs.decode_mla_kernel(1, 64) == configs.decode_mla_kernel(64, least) \
            == forced
    monkeypatch.setenv("FLASHTILE_DECODE_MLA", "cuda")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_MLA must be one of"):
        configs.decode_mla_kernel(1, least)


def test_gluon_mla_takes_only_the_absorbed_shape(monkeypatch):
    """decode_mla_hopper.unsupported: the absorbed shape (576/512, one KV head, V the
    cache's first 512 columns, more than 32 query rows), 16-bit, pages a multiple of
    the tile, TMA-ready strides, no feature but causal; anything else is named and
    goes to the portable kernel. (The device check is stood in for: this runs on CPU.)"""
    from flashtile.ops import decode_mla_hopper as mla
    monkeypatch.setattr(mla, "_on_hopper", lambda device: True)
    q = torch.empty(2, 1, 128, 576, dtype=torch.bfloat16)
    pool = torch.empty(8, 64, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    kw = dict(v_is_k=True, block_table=table, cache_batch_idx=None, cache_leftpad=None,
              alibi_slopes=None, window_left=-1, window_right=-1, softcap=0.0,
              descales=(None, None, None))
    assert mla.unsupported(q, pool, pool[..., :512], **kw) is None
    assert mla.unsupported(q, pool, pool[..., :512], **dict(kw, window_right=0)) is None
    assert mla.unsupported(q, pool[:2], pool[:2, ..., :512], **dict(kw, block_table=None)) \
        is None
    cases = [
        ((q[:, :, :16], pool, pool[..., :512]), {}, "16 query rows"),
        ((q, pool, pool[..., :512]), dict(v_is_k=False), "first 512 columns"),
        ((q, pool.view(32, 16, 1, 576), pool[..., :512]), {}, "page size 16"),
        ((q, pool.to(torch.float8_e4m3fn), pool[..., :512]), {}, "float16 or bfloat16"),
        ((q[..., :512], pool[..., :512], pool[..., :512]), {}, "absorbed MLA shape"),
        ((q, pool, pool[..., :512]), dict(cache_leftpad=table[:, 0]), "cache_leftpad"),
        ((q, pool, pool[..., :512]), dict(window_right=4), "window"),
        ((torch.empty(2, 128, 2, 576, dtype=torch.bfloat16).transpose(1, 2), pool,
          pool[..., :512]), {}, "h heads apart"),
    ]
    for args, change, reason in cases:
        assert reason in mla.unsupported(*args, **dict(kw, **change)), reason


@pytest.mark.parametrize("d, dv", [pytest.param(192, 128, id="d192-dv128"),
                                   pytest.param(24, 40, id="d24-dv40")])
def test_varlen_paged_value_head_dim(backend, d, dv, device):
    """flash_attn_varlen_func over a paged pool whose v has its own head dim."""
    dtype = torch.float16
    b, s, h, hkv = 2, 48, 4, 2
    k_cache, v_cache = _caches(b, s, hkv, d, dv, False, dtype, device)
    pool_k, pool_v, block_table = _pool(k_cache, v_cache, False)
    lens_q, lens_k = [3, 5], [19, 48]
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    seqused_k = torch.tensor(lens_k, dtype=torch.int32, device=device)
    out = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, None, 5, 48,
                                           causal=True, block_table=block_table,
                                           seqused_k=seqused_k)
    assert out.shape == (8, h, dv)
    for i in range(b):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        qkv = (q[None, rows], k_cache[i:i + 1, :lens_k[i]], v_cache[i:i + 1, :lens_k[i]])
        o64, _ = attention_naive(*(x.double() for x in qkv), causal=True)
        o_pt, _ = attention_naive(*qkv, causal=True, upcast=False)
        assert_close_rule(f"out[{i}]", out[None, rows], o64, o_pt)


@pytest.mark.parametrize("shared", [True, False], ids=["d576-dv512-shared", "d192-dv128-append"])
def test_compiled_decode_step(shared, device):
    """torch.compile(fullgraph=True) of a decode step: the custom op's fake gives out
    v's head dim, and the compiled step equals the eager one (caches included)."""
    d, dv = (576, 512) if shared else (192, 128)
    k_cache, v_cache = _caches(2, 32, 1, d, dv, shared, torch.float32, device)
    q = torch.randn(2, 1, 4, d, device=device)
    k, v = (None, None) if shared else (torch.randn(2, 1, 1, d, device=device),
                                        torch.randn(2, 1, 1, dv, device=device))
    seqlens = torch.tensor([5, 30], dtype=torch.int32, device=device)

    def step(q, k_cache, v_cache, k, v):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                 cache_seqlens=seqlens, causal=True)

    def caches():
        kc = k_cache.clone()
        return (kc, kc[..., :dv]) if shared else (kc, v_cache.clone())

    eager_caches, compiled_caches = caches(), caches()
    want = step(q, *eager_caches, k, v)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, *compiled_caches, k, v)
    assert got.shape == (2, 1, 4, dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for x, y in zip(compiled_caches, eager_caches):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "PagedKVCache"])
def test_kv_cache_classes_take_value_head_dim(backend, paged, device):
    """KVCache and PagedKVCache with head_dim_v: v_cache has its own last dim, writes
    check each against its own, and the caches feed flash_attn_with_kvcache."""
    from flashtile.kv_cache import KVCache, PagedKVCache

    d, dv, h, hkv, n, dtype = 24, 40, 4, 2, 21, torch.float16
    k = torch.randn(2, n, hkv, d, dtype=dtype, device=device)
    v = torch.randn(2, n, hkv, dv, dtype=dtype, device=device)
    q = torch.randn(2, 1, h, d, dtype=dtype, device=device)
    if paged:
        cache = PagedKVCache(8, 16, 1, hkv, d, dtype=dtype, device=device, head_dim_v=dv)
        for i in range(2):
            cache.add_sequence(i)
            cache.append(i, k[i][None], v[i][None])
        plan = cache.plan([0, 1])
        kw = dict(block_table=plan.block_table, cache_seqlens=plan.cache_seqlens)
    else:
        cache = KVCache(2, 32, 1, hkv, d, dtype=dtype, device=device, head_dim_v=dv)
        cache.update(0, 0, k, v)
        kw = dict(cache_seqlens=cache.cache_seqlens)
    assert cache.v_cache.shape[-1] == dv and cache.k_cache.shape[-1] == d
    out, lse = flashtile.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0],
                                                 return_lse=True, **kw)
    _check(out, lse, q, k, v, torch.tensor([n, n]), causal=False)
    # A v of k's head dim is refused, naming v's.
    if paged:
        cache.reserve(0, 1)
        with pytest.raises(ValueError, match=r"v.shape: expected \(1, nheads_kv=2, "
                                             r"head_dim=40\), got \(1, 2, 24\)"):
            cache.write(0, 0, k[0, :1], k[0, :1])
    else:
        with pytest.raises(ValueError, match=r"v.shape: expected \(batch, n_new, "
                                             r"nheads_kv=2, head_dim=40\), got "
                                             r"\(2, 1, 2, 24\)"):
            cache.update(0, n, k[:, :1], k[:, :1])


@pytest.mark.parametrize("cls", ["KVCache", "PagedKVCache"])
def test_kv_cache_classes_head_dim_errors(cls):
    from flashtile import kv_cache

    make = (lambda **kw: kv_cache.KVCache(1, 16, 1, 1, **kw)) if cls == "KVCache" else \
        (lambda **kw: kv_cache.PagedKVCache(1, 16, 1, 1, **kw))
    assert make(head_dim=576, head_dim_v=512).v_cache.shape[-1] == 512
    with pytest.raises(ValueError, match=r"head_dim_v: expected 1 to 512 \(None: head_dim\)"
                                         r", got 576"):
        make(head_dim=576, head_dim_v=576)
    with pytest.raises(ValueError, match=r"head_dim: expected 1 to 512, or 576, got 600"):
        make(head_dim=600)


# ---- bad input ----

def _args(d=64, dv=32, shared=False, s=16):
    k_cache, v_cache = _caches(1, s, 1, d, dv, shared, torch.float32, "cpu")
    return torch.randn(1, 1, 2, d), k_cache, v_cache


def test_error_cache_dims_other_than_head_dim():
    q, k_cache, _ = _args()
    with pytest.raises(ValueError, match=r"v_cache.shape\[:-1\]: expected k_cache's "
                                         r"\(1, 16, 1\), got \(1, 17, 1\)"):
        flashtile.flash_attn_with_kvcache(q, k_cache, torch.randn(1, 17, 1, 32),
                                          cache_seqlens=4)


def test_error_new_v_of_other_head_dim():
    q, k_cache, v_cache = _args()
    with pytest.raises(ValueError, match=r"v.shape: expected \(1, seqlen_new, 1, 32\), "
                                         r"got \(1, 1, 1, 64\)"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k=torch.randn(1, 1, 1, 64),
                                          v=torch.randn(1, 1, 1, 64), cache_seqlens=4)


def test_error_head_dims_past_the_kernels():
    q, k_cache, v_cache = _args(d=600, dv=512)
    with pytest.raises(ValueError, match=r"q.shape\[-1\] \(head_dim\): expected 1 to 512, "
                                         r"or 576 \(absorbed MLA"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4)
    q, k_cache, v_cache = _args(d=576, dv=576)
    with pytest.raises(ValueError, match=r"v_cache.shape\[-1\] \(head_dim_v\): expected "
                                         r"1 to 512, got 576"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4)


@pytest.mark.parametrize("call", ["dense", "varlen", "paged_varlen"])
def test_error_576_outside_kvcache(call):
    """576 is the decode kernel's (a 512 tile plus a tail): elsewhere the message says
    where it is taken."""
    q, k, v = torch.randn(1, 3, 1, 576), torch.randn(1, 16, 1, 576), torch.randn(1, 16, 1, 512)
    match = (r"q.shape\[-1\] \(head_dim\): expected 1 to 512, got 576. head_dim 576 "
             r"\(absorbed MLA\) is taken by flash_attn_with_kvcache only")
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        if call == "dense":
            flashtile.flash_attn_func(q, k, v)
        elif call == "varlen":
            flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 3, 3)
        else:
            flashtile.flash_attn_varlen_func(
                q[0], k, v, cu, None, 3, 3, block_table=torch.zeros(1, 1, dtype=torch.int32),
                seqused_k=torch.tensor([3], dtype=torch.int32))


def test_error_append_into_shared_elements():
    """New k/v into a V that is a view of K's rows: which lands in the shared columns
    is not defined, so it is refused with the cache untouched."""
    q, k_cache, v_cache = _args(d=64, dv=32, shared=True)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"k/v: expected None when v_cache and k_cache "
                                         r"share elements"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k=torch.randn(1, 1, 1, 64),
                                          v=torch.randn(1, 1, 1, 32), cache_seqlens=4)
    assert torch.equal(k_cache, before)


def test_append_into_one_stacked_tensor_is_taken():
    """K and V as halves of one tensor (vLLM's (2, num_blocks, ...) pool, or k/v
    interleaved per head) share a storage, not elements: appending stays allowed."""
    kv = torch.randn(2, 4, 16, 1, 8)
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    flashtile.flash_attn_with_kvcache(q, kv[0], kv[1], k=k, v=v, cache_seqlens=4,
                                      block_table=torch.tensor([[2]], dtype=torch.int32))
    assert torch.equal(kv[0, 2, 4], k[0, 0]) and torch.equal(kv[1, 2, 4], v[0, 0])


def test_views_overlap():
    from flashtile._validate import views_overlap

    kv = torch.randn(4, 16, 2, 3, 8)
    disjoint = [(kv[:, :, 0], kv[:, :, 1]), (kv[..., :4], kv[..., 4:]), (kv, kv.clone()),
                (kv[:1], kv[2:])]
    shared = [(kv, kv), (kv, kv[..., :4]), (kv[..., :5], kv[..., 4:]),
              (kv[..., 2:6], kv[..., :3]), (kv[1:], kv[..., :4])]
    for a, b in disjoint:
        assert not views_overlap(a, b) and not views_overlap(b, a)
    for a, b in shared:
        assert views_overlap(a, b) and views_overlap(b, a)


def test_error_paged_varlen_pool_shapes():
    q = torch.randn(3, 2, 64)
    k, v = torch.randn(4, 16, 1, 64), torch.randn(5, 16, 1, 32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"v.shape\[:-1\]: expected k's \(4, 16, 1\), "
                                         r"got \(5, 16, 1\)"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, None, 3, 3,
                                         block_table=torch.zeros(1, 1, dtype=torch.int32),
                                         seqused_k=torch.tensor([3], dtype=torch.int32))


# ---- GPU, bf16 (make test-gpu) ----

@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1], ids=["splits-heuristic", "unsplit"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_q, nheads", [(1, 16), (1, 64), (1, 128), (2, 128)])
def test_gpu_absorbed_mla_decode(seqlen_q, nheads, paged, num_splits, device):
    """DeepSeek's absorbed decode at its shape: 16, 64 or 128 query heads over one
    latent cache of 576 (512 + 64 rope) whose first 512 columns are V; bf16. The rows
    (tokens x heads) pick the tile (configs._wide_key_decode_config): 16 rows mma.sync,
    64 one 64-row wgmma program, 128 and 256 rows of 128 with V's columns in two
    programs."""
    dtype, b, s = torch.bfloat16, 3, 1024
    k_cache, v_cache = _caches(b, s, 1, 576, 512, True, dtype, device)
    q = torch.randn(b, seqlen_q, nheads, 576, dtype=dtype, device=device)
    seqlens = torch.tensor([1 + seqlen_q, 517, 1024], dtype=torch.int32, device=device)
    out, lse, _, _ = _attend(q, k_cache, v_cache, paged, True, cache_seqlens=seqlens,
                             causal=True, num_splits=num_splits, softmax_scale=192 ** -0.5)
    for i, n in enumerate(seqlens.tolist()):
        qkv = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
        kw_ref = dict(causal=True, softmax_scale=192 ** -0.5)
        o64, l64 = attention_naive(*(x.double() for x in qkv), **kw_ref)
        o_pt, _ = attention_naive(*qkv, upcast=False, **kw_ref)
        assert_close_rule(f"out[{i}]", out[i:i + 1], o64, o_pt)
        torch.testing.assert_close(lse[i:i + 1].double(), l64, rtol=1e-3, atol=1e-3)


# The Gluon absorbed decode's ring depths (FLASHTILE_HOPPER_MLA_DECODE_CONFIG), as the
# mla stage of scripts/gpu_session.sh times them.
GLUON_MLA_TILES = ["64,32,4,4", "64,32,4,3"]


@pytest.fixture
def gluon_mla(monkeypatch):
    """FLASHTILE_DECODE_MLA=gluon; yields the list of calls the Gluon kernel took."""
    from flashtile.ops import _launch, decode_mla_hopper
    monkeypatch.setenv("FLASHTILE_DECODE_MLA", "gluon")
    calls, real = [], decode_mla_hopper.attn_decode

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(decode_mla_hopper, "attn_decode", spy)
    _launch.clear()
    yield calls
    _launch.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 3], ids=["splits-heuristic", "unsplit",
                                                       "split3"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("seqlen_q, nheads", [(1, 48), (1, 64), (1, 128), (2, 128)])
@pytest.mark.parametrize("tile", GLUON_MLA_TILES)
def test_gpu_absorbed_mla_decode_gluon(tile, seqlen_q, nheads, paged, num_splits, device,
                                       gluon_mla, monkeypatch):
    """The Gluon kernel (ops/decode_mla_hopper.py) at DeepSeek's absorbed shape, bf16,
    causal: 48 heads (one 64-row block, 16 rows padded), 64, 128 (two blocks) and two
    tokens of 128 (four), over pages of 64 keys or contiguous caches. The cache rows
    past each sequence hold NaN: the last tile's keys past the sequence must count for
    nothing (their V rows are zeroed before P V). Lengths 3 (one partial tile), 517 (a
    partial last tile) and 1024 (whole tiles); three splits leave the short sequences
    empty splits."""
    monkeypatch.setenv("FLASHTILE_HOPPER_MLA_DECODE_CONFIG", tile)
    dtype, b, s = torch.bfloat16, 3, 1024
    k_cache, v_cache = _caches(b, s, 1, 576, 512, True, dtype, device)
    seqlens = torch.tensor([1 + seqlen_q, 517, 1024], dtype=torch.int32, device=device)
    for i, n in enumerate(seqlens.tolist()):
        k_cache[i, n:] = float("nan")
    q = torch.randn(b, seqlen_q, nheads, 576, dtype=dtype, device=device)
    kw = dict(causal=True, softmax_scale=192 ** -0.5)
    out, lse, _, _ = _attend(q, k_cache, v_cache, paged, True, page_size=64,
                             cache_seqlens=seqlens, num_splits=num_splits, **kw)
    assert gluon_mla, "the Gluon kernel did not take the call"
    for i, n in enumerate(seqlens.tolist()):
        qkv = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
        o64, l64 = attention_naive(*(x.double() for x in qkv), **kw)
        o_pt, _ = attention_naive(*qkv, upcast=False, **kw)
        assert_close_rule(f"out[{i}]", out[i:i + 1], o64, o_pt)
        torch.testing.assert_close(lse[i:i + 1].double(), l64, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
def test_gpu_absorbed_mla_auto_route(paged, device, gluon_mla, monkeypatch):
    """FLASHTILE_DECODE_MLA=auto (the default): the Gluon kernel takes the absorbed
    decode from batch x capacity DECODE_MLA_GLUON_MIN_KEYS keys, the portable kernel
    below; both exact against float64 on keys that fill a fraction of the capacity."""
    monkeypatch.delenv("FLASHTILE_DECODE_MLA")  # the fixture's spy stays
    calls = gluon_mla
    dtype, b = torch.bfloat16, 2
    for s, gluon in ((configs.DECODE_MLA_GLUON_MIN_KEYS // b, True),
                     (configs.DECODE_MLA_GLUON_MIN_KEYS // b - 64, False)):
        calls.clear()
        k_cache, v_cache = _caches(b, s, 1, 576, 512, True, dtype, device)
        seqlens = torch.tensor([300, 1000], dtype=torch.int32, device=device)
        q = torch.randn(b, 1, 64, 576, dtype=dtype, device=device)
        out, _, _, _ = _attend(q, k_cache, v_cache, paged, True, page_size=64,
                               cache_seqlens=seqlens)
        assert bool(calls) == gluon, (s, calls)
        for i, n in enumerate(seqlens.tolist()):
            qkv = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
            o64, _ = attention_naive(*(x.double() for x in qkv))
            assert_close_rule(f"out[{i}]", out[i:i + 1],
                              o64, attention_naive(*qkv, upcast=False)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split3"])
def test_gpu_absorbed_gluon_bad_indices(num_splits, device, gluon_mla):
    """As the portable kernel (tests/test_index_safety.py), the Gluon kernel reads no
    index on the host: a block-table entry outside the pool is not followed and the
    rows that see its keys are NaN; a key count past the block table's capacity makes
    its sequence's rows NaN; the other sequence stays exact. The lead runs this under
    compute-sanitizer too (make memcheck, MEMCHECK_K)."""
    dtype, b, s, h = torch.bfloat16, 3, 256, 128
    k_cache, v_cache = _caches(b, s, 1, 576, 512, True, dtype, device)
    q = torch.randn(b, 1, h, 576, dtype=dtype, device=device)
    pool, _, table = _pool(k_cache, v_cache, True, 64)
    table[1, 2] = pool.shape[0] + 5  # sequence 1: its third page outside the pool
    seqlens = torch.tensor([s, s, 100 * s], dtype=torch.int32, device=device)
    out, lse = flashtile.flash_attn_with_kvcache(
        q, pool, pool[..., :512], block_table=table, cache_seqlens=seqlens,
        num_splits=num_splits, return_lse=True)
    assert gluon_mla
    for i in (1, 2):
        assert torch.isnan(out[i]).all() and torch.isnan(lse[i]).all(), i
    qkv = (q[:1], k_cache[:1], v_cache[:1])
    o64, l64 = attention_naive(*(x.double() for x in qkv))
    assert_close_rule("out[0]", out[:1], o64, attention_naive(*qkv, upcast=False)[0])
    torch.testing.assert_close(lse[:1].double(), l64, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_absorbed_gluon_leaves_other_calls_to_triton(device, gluon_mla):
    """With FLASHTILE_DECODE_MLA=gluon, calls the Gluon kernel does not take (16 heads,
    pages of 16 keys) still decode, on the portable kernel."""
    dtype, b, s = torch.bfloat16, 2, 256
    k_cache, v_cache = _caches(b, s, 1, 576, 512, True, dtype, device)
    seqlens = torch.tensor([100, 256], dtype=torch.int32, device=device)
    for heads, paged in ((16, False), (128, True)):
        q = torch.randn(b, 1, heads, 576, dtype=dtype, device=device)
        out, _, _, _ = _attend(q, k_cache, v_cache, paged, True, page_size=16,
                               cache_seqlens=seqlens)
        for i, n in enumerate(seqlens.tolist()):
            qkv = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
            o64, _ = attention_naive(*(x.double() for x in qkv))
            assert_close_rule(f"out[{i}]", out[i:i + 1],
                              o64, attention_naive(*qkv, upcast=False)[0])
    assert not gluon_mla


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d, dv", [(192, 128), (64, 256)], ids=["d192-dv128", "d64-dv256"])
def test_gpu_value_head_dim_with_append(d, dv, paged, device):
    """bf16 GQA decode with appended tokens, V's head dim its own."""
    dtype, b, s, h, hkv, sn = torch.bfloat16, 4, 512, 16, 2, 1
    k_cache, v_cache = _caches(b, s, hkv, d, dv, False, dtype, device)
    q = torch.randn(b, sn, h, d, dtype=dtype, device=device)
    k = torch.randn(b, sn, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, sn, hkv, dv, dtype=dtype, device=device)
    start = torch.tensor([0, 100, 333, 511], dtype=torch.int32, device=device)
    out, lse, k_cache, v_cache = _attend(q, k_cache, v_cache, paged, False, k=k, v=v,
                                         cache_seqlens=start, causal=True)
    _check(out, lse, q, k_cache, v_cache, start + sn, causal=True)


@pytest.mark.gpu
def test_gpu_launch_plans_tell_shared_from_own_v(device):
    """Launch plans are keyed on whether V is read from K's tiles: a V view of another
    tensor, with the same shape and strides as the shared one, must not replay the
    shared plan (it would read K's rows for V)."""
    dtype = torch.bfloat16
    kv = torch.randn(2, 256, 1, 576, dtype=dtype, device=device)
    other = torch.randn_like(kv)
    q = torch.randn(2, 1, 16, 576, dtype=dtype, device=device)
    seqlens = torch.tensor([100, 256], dtype=torch.int32, device=device)
    for v_cache in (kv[..., :512], other[..., :512], kv[..., :512]):
        out = flashtile.flash_attn_with_kvcache(q, kv, v_cache, cache_seqlens=seqlens)
        for i, n in enumerate(seqlens.tolist()):
            qkv = (q[i:i + 1], kv[i:i + 1, :n], v_cache[i:i + 1, :n])
            o64, _ = attention_naive(*(x.double() for x in qkv))
            o_pt, _ = attention_naive(*qkv, upcast=False)
            assert_close_rule(f"out[{i}]", out[i:i + 1], o64, o_pt)


@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "PagedKVCache"])
def test_kv_cache_classes_shared_latent(backend, paged, device):
    """shared_kv (absorbed MLA): v_cache is k_cache's first head_dim_v columns, writes
    take k alone, and attention over the cache equals attention with v = k[..., :dv]
    (the shared-rows path of flash_attn_with_kvcache); copy-on-write keeps the view."""
    from flashtile.kv_cache import KVCache, PagedKVCache

    d, dv, h, n, dtype = 48, 40, 4, 21, torch.float16
    k = torch.randn(2, n, 1, d, dtype=dtype, device=device)
    q = torch.randn(2, 1, h, d, dtype=dtype, device=device)
    if paged:
        cache = PagedKVCache(8, 16, 1, 1, d, dtype=dtype, device=device, head_dim_v=dv,
                             shared_kv=True)
        cache.add_sequence(0)
        cache.append(0, k[0, :n - 1][None])
        # Sequence 1 shares 0's partly filled last block, copied when 1 appends its own
        # last token: the copy must keep v (k's first columns) too.
        cache.fork(0, 1)
        cache.append(0, k[0, n - 1:][None])
        cache.append(1, k[1, n - 1:][None])
        assert cache.blocks(0)[-1] != cache.blocks(1)[-1]
        plan = cache.plan([0, 1])
        kw = dict(block_table=plan.block_table, cache_seqlens=plan.cache_seqlens)
        k = torch.cat([k[:1, :n - 1].expand(2, -1, -1, -1), k[:, n - 1:]], 1)
    else:
        cache = KVCache(2, 32, 1, 1, d, dtype=dtype, device=device, head_dim_v=dv,
                        shared_kv=True)
        cache.update(0, 0, k)
        kw = dict(cache_seqlens=cache.cache_seqlens)
    assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()
    assert cache.v_cache.shape[-1] == dv
    out, lse = flashtile.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0],
                                                 return_lse=True, **kw)
    _check(out, lse, q, k, k[..., :dv], torch.tensor([n, n]), causal=False)


@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "PagedKVCache"])
def test_kv_cache_shared_latent_errors(paged):
    from flashtile.kv_cache import KVCache, PagedKVCache

    make = (lambda **kw: PagedKVCache(4, 16, 1, 1, 48, **kw)) if paged else \
        (lambda **kw: KVCache(1, 16, 1, 1, 48, **kw))
    with pytest.raises(ValueError, match=r"head_dim_v: expected less than head_dim=48 "
                                         r"with shared_kv"):
        make(shared_kv=True)  # head_dim_v defaults to head_dim: nothing of its own
    with pytest.raises(TypeError, match=r"shared_kv: expected a bool, got int"):
        make(head_dim_v=40, shared_kv=1)
    shared, plain = make(head_dim_v=40, shared_kv=True), make(head_dim_v=40)
    k = torch.randn(1, 1, 1, 48, dtype=torch.float16)
    v = torch.randn(1, 1, 1, 40, dtype=torch.float16)
    if paged:
        for cache in (shared, plain):
            cache.add_sequence(0)
        with pytest.raises(ValueError, match=r"layer_v: expected None for a shared_kv "
                                             r"cache"):
            shared.append(0, k, v)
        with pytest.raises(TypeError, match=r"layer_v: expected a torch.Tensor, got None"):
            plain.append(0, k)
        assert shared.seqlen(0) == plain.seqlen(0) == 0  # nothing reserved
    else:
        with pytest.raises(ValueError, match=r"v: expected None for a shared_kv cache"):
            shared.update(0, 0, k[0], v[0])
        with pytest.raises(TypeError, match=r"v: expected a torch.Tensor, got None"):
            plain.update(0, 0, k[0])
