"""Split decode's compiled variants stay few: a short split's page list (SPLIT_PAGES) is
rounded up to a power of two, and the integers that follow the batch or the cache are not
specialised on, so an eager engine compiles none of them while serving (issues 14, 15)."""

import os

import pytest
import torch

import flashtile
from flashtile.ops import combine, configs, decode
from flashtile.reference import attention_naive
from tests.utils import assert_close_rule

# A block-table entry no pool holds: a kernel that followed it would give NaN rows.
NO_PAGE = 2**31 - 1
BOUNDED = {0, 2, 4, 8, 16}


def _span(keys_per_split, page_size):
    """Pages a split of keys_per_split keys spans (one more when it may start inside a
    page)."""
    return -(-keys_per_split // page_size) + int(keys_per_split % page_size != 0)


@pytest.mark.parametrize("page_size,block_n,capacity,num_splits", [
    (64, 16, 256, 4),    # 1 page a split, a list of 2: page > tile
    (16, 16, 144, 3),    # 3 pages a split, a list of 4: page == tile
    (16, 16, 400, 5),    # 5 pages, a list of 8
    (64, 16, 320, 4),    # 80 keys from inside a page: 3 pages, a list of 4: page > tile
    (16, 64, 576, 3),    # 12 pages, a list of 16: 4 pages a tile
    (32, 64, 576, 3),    # 6 pages, a list of 8: 2 pages a tile
], ids=["page64-1of2", "page16-3of4", "page16-5of8", "page64-3of4", "tile_pages-12of16",
        "tile_pages-6of8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_rounded_page_list_matches_float64(page_size, block_n, capacity, num_splits, dtype,
                                           device, on_gpu):
    """Paged split decode with a page list longer than the split's pages equals the
    float64 oracle. The block table is tight (the last split's list reaches past the
    row: those entries must not be read, which only memcheck can see, on the GPU) and
    holds an id outside the pool past each sequence's pages, which a followed entry
    would turn into NaN rows."""
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton kernels")
    configs.set_override("decode", configs.TileConfig(16, block_n, 4, 2))
    try:
        b, h, hkv, d = 2, 4, 2, 16
        width = capacity // page_size
        splits, keys_per_split, split_pages = decode.split_plan(
            b * hkv, capacity, block_n, page_size, num_splits, 1, False)
        assert splits == num_splits and split_pages > _span(keys_per_split, page_size)
        gen = torch.Generator().manual_seed(3)
        lens = [capacity - 2 * page_size - 5, capacity - 3]
        pool_k = torch.randn(b * width + 2, page_size, hkv, d, generator=gen).to(dtype)
        pool_v = torch.randn(b * width + 2, page_size, hkv, d, generator=gen).to(dtype)
        order = torch.randperm(pool_k.shape[0], generator=gen)[:b * width]
        block_table = order.view(b, width).to(torch.int32)
        block_table[0, -(-lens[0] // page_size):] = NO_PAGE
        q = torch.randn(b, 1, h, d, generator=gen).to(dtype)
        out, lse = flashtile.flash_attn_with_kvcache(
            *(x.to(device) for x in (q, pool_k, pool_v)),
            cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_table=block_table.to(device), causal=True, num_splits=num_splits,
            return_lse=True)
        out, lse = out.cpu(), lse.cpu()
        for i, n in enumerate(lens):
            pages = block_table[i, :-(-n // page_size)].long()
            k, v = (pool[pages].flatten(0, 1)[None, :n] for pool in (pool_k, pool_v))
            ref, ref_lse = attention_naive(q[i:i + 1].double(), k.double(), v.double(),
                                           causal=True)
            same_dtype, _ = attention_naive(q[i:i + 1], k, v, causal=True, upcast=False)
            assert_close_rule(f"out[{i}]", out[i:i + 1], ref, same_dtype)
            torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, rtol=0,
                                       atol=1e-5)
    finally:
        configs.set_override("decode", None)


def test_split_pages_take_few_values():
    """Across batch sizes, cache lengths, page sizes, tiles and split counts (the
    heuristic's on 132 SMs, and explicit ones), SPLIT_PAGES is 0 or a power of two from
    2 to MAX_SPLIT_PAGES, never shorter than the pages a split spans, and the combine's
    BLOCK_S a power of two up to 128. Before the rounding it took every value 1-16."""
    seen = set()
    for page_size in (16, 32, 64, 128, 256):
        for block_n in (16, 32, 64):
            for pages in range(1, 300, 7):
                capacity = pages * page_size
                for work in (1, 2, 8, 24, 64, 131):
                    for requested in (0, 2, 3, 5, 7, 16, 33, 128):
                        splits, keys_per_split, split_pages = decode.split_plan(
                            work, capacity, block_n, page_size, requested, 132, False)
                        assert keys_per_split % block_n == 0
                        assert 1 <= splits <= max(requested, 128)
                        assert split_pages in BOUNDED
                        if split_pages:
                            assert split_pages >= _span(keys_per_split, page_size)
                        else:
                            assert splits == 1 or _span(keys_per_split, page_size) \
                                > decode.MAX_SPLIT_PAGES
                        assert configs.next_power_of_2(splits) <= 128
                        seen.add(split_pages)
    assert seen == BOUNDED
    # A left pad looks pages up per key row; a contiguous cache has none.
    assert decode.split_plan(8, 4096, 64, 64, 0, 132, True)[2] == 0
    assert decode.split_plan(8, 4096, 64, 0, 0, 132, False)[2] == 0


def test_warm_shapes_cover_every_variant(monkeypatch):
    """The (batch, width) pairs an eager engine warms up with meet every decode variant
    (split or not, SPLIT_PAGES) and combine BLOCK_S that any batch up to 256 and any
    block-table width (multiples of 16 pages up to 32k keys) meets, on an H200-like 132
    SMs with the GPU's tiles (a meta q stands for a CUDA one); a few pairs only."""
    monkeypatch.setattr(decode, "_num_sms", lambda q: 132)
    q = torch.empty(1, 1, 32, 64, dtype=torch.bfloat16, device="meta")
    pool = torch.empty(1000, 64, 8, 64, dtype=torch.bfloat16, device="meta")
    batches, widths = range(1, 257), range(16, 513, 16)
    shapes = decode.paged_decode_warm_shapes(q, pool, pool.clone(), batches, widths)
    cfg = configs.decode_config(q, 64, 4)

    def variants(b, width):
        splits, _, split_pages = decode.split_plan(b * 8, width * 64, cfg.block_n, 64, 0,
                                                   132, False)
        return {("decode", splits > 1, split_pages)} | (
            {("combine", configs.next_power_of_2(splits))} if splits > 1 else set())

    everything = set().union(*(variants(b, w) for b in batches for w in widths))
    assert set().union(*(variants(b, w) for b, w in shapes)) == everything
    assert len(shapes) <= len(everything) <= 1 + 4 + 1 + 7
    assert {v[2] for v in everything if v[0] == "decode"} <= BOUNDED


@pytest.mark.gpu
def test_no_compile_after_warm_shapes(device):
    """On the GPU: after the warm-up pairs, paged decodes at other batch sizes and widths
    (and cache lengths) compile no decode or combine kernel."""
    torch.manual_seed(0)
    h, hkv, d, ps = 32, 8, 64, 64
    pool_k = torch.randn(600, ps, hkv, d, device=device, dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    widths = range(16, 129, 16)

    def run(b, width):
        q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16)
        table = torch.randint(0, 600, (b, width), device=device, dtype=torch.int32)
        lens = torch.randint(1, width * ps + 1, (b,), device=device, dtype=torch.int32)
        flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                          block_table=table, causal=True)

    for b, width in decode.paged_decode_warm_shapes(
            torch.empty(1, 1, h, d, device=device, dtype=torch.bfloat16), pool_k, pool_v,
            range(1, 65), widths):
        run(b, width)
    dev = torch.cuda.current_device()
    counts = [len(k.device_caches[dev][0]) for k in (decode._decode_kernel,
                                                     combine._combine_kernel)]
    for b in (1, 2, 3, 5, 7, 11, 16, 33, 64):
        for width in widths:
            run(b, width)
    assert [len(k.device_caches[dev][0]) for k in (decode._decode_kernel,
                                                   combine._combine_kernel)] == counts


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_fp8_cache_tiles_take_twice_the_keys(head_dim, split):
    """An FP8 cache's decode tile holds the bytes of the 16-bit cache's: twice the keys
    at the same stages, up to 16 query rows (64 rows x 128 keys spilled on sm_90)."""
    q = torch.empty(1, dtype=torch.bfloat16, device="meta")  # a GPU q's tile
    for rows, factor in ((4, 2), (16, 2), (64, 1)):
        bf16 = configs.decode_config(q, head_dim, rows, split=split)
        fp8 = configs.decode_config(q, head_dim, rows, split=split, fp8_cache=True)
        assert fp8 == configs.TileConfig(bf16.block_m, factor * bf16.block_n,
                                         bf16.num_warps, bf16.num_stages)
