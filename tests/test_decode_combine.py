"""Split decode's two ways of merging its splits (FLASHTILE_DECODE_COMBINE,
flashtile.ops.combine): the combine kernel, and the decode kernel's last program of each
row block ("fused": one launch, counters in a persistent workspace). Both against the
float64 oracle and against each other; the fused one's counters, fallbacks and switch.
The decode tests that split (test_decode, test_decode_variants, test_fp8, test_mla_cache,
test_nan, test_index_safety, test_decode_host) run in both modes (``decode_combine``)."""

import os

import pytest
import torch

import flashtile
from flashtile.ops import combine, configs
from flashtile.reference import attention_naive
from tests.utils import assert_close_rule


@pytest.fixture
def triton_kernels(on_gpu, monkeypatch):
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton kernels")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")


@pytest.fixture
def launches(monkeypatch):
    """The combine kernel's launches: a list that each one appends to."""
    seen = []
    launch = combine.launch_combine

    def spy(*args, **kwargs):
        seen.append(args[2])  # num_splits
        return launch(*args, **kwargs)
    monkeypatch.setattr(combine, "launch_combine", spy)
    return seen


def _decode(q, k_cache, v_cache, lens, mode, monkeypatch, page=None, **kw):
    """flash_attn_with_kvcache with FLASHTILE_DECODE_COMBINE=mode, over the caches or,
    with page, a pool of their pages in a scrambled order."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", mode)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    if page:
        b, s, hkv, d = k_cache.shape
        gen = torch.Generator().manual_seed(5)
        table = torch.randperm(b * s // page, generator=gen).view(b, -1).int().to(q.device)
        pools = [torch.empty(b * s // page, page, hkv, x.shape[-1], dtype=x.dtype,
                             device=q.device) for x in (k_cache, v_cache)]
        for pool, cache in zip(pools, (k_cache, v_cache)):
            pool[table.long()] = cache.view(b, s // page, page, hkv, -1)
        k_cache, v_cache = pools
        kw["block_table"] = table
    return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             return_lse=True, **kw)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_equals_kernel_and_float64(dtype, seqlen_q, page, num_splits, triton_kernels,
                                         launches, device, monkeypatch):
    """GQA (4 query heads a KV head), odd lengths and a full cache, causal: the fused
    merge against float64 (the accuracy rule), and against the combine kernel to fp32
    rounding (they differ only in the order of the sums over the splits)."""
    b, s, h, hkv, d = 3, 96, 8, 2, 32
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(b, s, hkv, d, generator=gen).to(device, dtype)
                        for _ in "kv")
    q = torch.randn(b, seqlen_q, h, d, generator=gen).to(device, dtype)
    lens = [37, 96, 61]
    kw = dict(causal=True, num_splits=num_splits)
    out, lse = _decode(q, k_cache, v_cache, lens, "fused", monkeypatch, page, **kw)
    assert launches == []
    kernel_out, kernel_lse = _decode(q, k_cache, v_cache, lens, "kernel", monkeypatch, page,
                                     **kw)
    assert len(launches) == 1
    # fp32 sums in another order; a 16-bit out may round one ulp apart.
    tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out, kernel_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, kernel_lse, rtol=1e-6, atol=1e-6)
    for i, n in enumerate(lens):
        ref, ref_lse = attention_naive(q[i:i + 1].double(), k_cache[i:i + 1, :n].double(),
                                       v_cache[i:i + 1, :n].double(), causal=True)
        same_dtype, _ = attention_naive(q[i:i + 1], k_cache[i:i + 1, :n],
                                        v_cache[i:i + 1, :n], causal=True, upcast=False)
        assert_close_rule(f"out[{i}]", out[i:i + 1], ref, same_dtype)
        torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, rtol=0, atol=1e-5)


def test_fused_calls_repeat_bit_for_bit(triton_kernels, device, monkeypatch):
    """Each call's last programs reset their counters: a second and a third call give
    the first call's outputs bit for bit, and leave every counter 0."""
    b, s, h, hkv, d = 2, 80, 4, 2, 16
    k_cache, v_cache = (torch.randn(b, s, hkv, d, device=device) for _ in "kv")
    q = torch.randn(b, 1, h, d, device=device)
    calls = [_decode(q, k_cache, v_cache, [80, 33], "fused", monkeypatch, num_splits=5)
             for _ in range(3)]
    for out, lse in calls[1:]:
        assert torch.equal(out, calls[0][0]) and torch.equal(lse, calls[0][1])
    assert all(not c.any() for c in combine._counters.values())


def test_fused_empty_and_nan_sequences(triton_kernels, device, monkeypatch):
    """As the combine kernel: a sequence with no keys is (0, -inf); a NaN key in one
    split (not the last) makes its KV head's rows NaN, and nothing else; a sequence
    longer than its cache is NaN (every split of it); splits past a sequence's end are
    left out of the merge without changing a bit."""
    b, s, h, hkv, d = 4, 64, 4, 2, 16
    k_cache, v_cache = (torch.randn(b, s, hkv, d, device=device) for _ in "kv")
    k_cache[2, 9, 0, 3] = float("nan")    # split 0 of 4 (16 keys each), KV head 0
    v_cache[1, 50:] = float("nan")        # past sequence 1's end: read by nothing
    q = torch.randn(b, 1, h, d, device=device)
    lens, kw = [0, 50, 64, s + 1], dict(causal=True, num_splits=4)
    out, lse = _decode(q, k_cache, v_cache, lens, "fused", monkeypatch, **kw)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    assert torch.isnan(out[2, :, :2]).all() and torch.isnan(lse[2, :2]).all()
    assert torch.isfinite(out[2, :, 2:]).all() and torch.isfinite(lse[2, 2:]).all()
    assert torch.isnan(out[3]).all() and torch.isnan(lse[3]).all()
    kernel_out, kernel_lse = _decode(q, k_cache, v_cache, lens, "kernel", monkeypatch, **kw)
    torch.testing.assert_close(out, kernel_out, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(lse, kernel_lse, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("case", ["dv_parts", "wide_tile", "no_counters"])
def test_fused_falls_back_to_the_kernel(case, triton_kernels, launches, device,
                                        monkeypatch):
    """Where the fused merge does not serve, the combine kernel does, with the same
    result: V's columns in two programs (DV_PARTS), a row block's partials past
    configs.DECODE_MERGE_FP32 a thread (16 rows x 128 columns over the interpreter's 4
    warps: 16), and no counters (a CUDA graph captured before its stream had them)."""
    b, s, hkv = 2, 48, 1
    h, d, dv, shared = {"dv_parts": (8, 576, 512, True), "wide_tile": (16, 128, 128, False),
                        "no_counters": (4, 32, 32, False)}[case]
    k_cache = torch.randn(b, s, hkv, d, device=device)
    v_cache = k_cache[..., :dv] if shared else torch.randn(b, s, hkv, dv, device=device)
    q = torch.randn(b, 1, h, d, device=device)
    if case == "dv_parts":
        monkeypatch.setattr(configs, "_override", dict(configs._override))  # undone after
        configs.set_override("decode", configs.TileConfig(16, 16, 4, 2, dv_parts=2))
    if case == "no_counters":
        monkeypatch.setattr(combine, "split_counters", lambda q, n: None)
    lens = [19, 48]
    out, lse = _decode(q, k_cache, v_cache, lens, "fused", monkeypatch, causal=True,
                       num_splits=3)
    assert launches == [3]
    for i, n in enumerate(lens):
        ref, ref_lse = attention_naive(q[i:i + 1].double(), k_cache[i:i + 1, :n].double(),
                                       v_cache[i:i + 1, :n].double(), causal=True)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, rtol=0, atol=1e-5)


def test_fused_counters_grow_and_keep_the_old_buffer(triton_kernels, device, monkeypatch):
    """A call that needs more counters than the stream's buffer holds gets a new zeroed
    buffer, and so does the device's buffer for CUDA graphs; the old ones are kept (a
    captured graph may hold their address), and a later smaller call takes the new
    one."""
    monkeypatch.setattr(combine, "_counters", {})
    monkeypatch.setattr(combine, "_outgrown", [])
    monkeypatch.setattr(combine, "MIN_COUNTERS", 1)
    s, h, hkv, d = 40, 4, 2, 16
    results = []
    for b in (1, 3, 1):
        k_cache, v_cache = (torch.randn(b, s, hkv, d, device=device) for _ in "kv")
        q = torch.randn(b, 1, h, d, device=device)
        out, _ = _decode(q, k_cache, v_cache, [s - 3] * b, "fused", monkeypatch,
                         num_splits=3)
        ref, _ = attention_naive(q.double(), k_cache[:, :s - 3].double(),
                                 v_cache[:, :s - 3].double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
        results.append(combine.split_counters(q, 1))  # this stream's, as it is
    assert [c.numel() for c in results] == [2, 6, 6]  # b x 2 KV heads x 1 row block
    assert results[2] is results[1] and len(combine._counters) == 2
    assert any(c is results[0] for c in combine._outgrown) and len(combine._outgrown) == 2
    assert all(c.numel() == 6 for c in combine._counters.values())
    assert not any(c.any() for c in results)


def test_combine_mode_is_checked(monkeypatch):
    """A mistyped FLASHTILE_DECODE_COMBINE is an error naming the variable, its choices
    and the value given, not silently the default."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "fuse")
    with pytest.raises(ValueError, match=r"FLASHTILE_DECODE_COMBINE must be one of "
                                         r"\('kernel', 'fused'\), got 'fuse'"):
        combine.combine_mode()
    for value, mode in (("kernel", "kernel"), (" fused ", "fused"), ("", "kernel")):
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", value)
        assert combine.combine_mode() == mode
    monkeypatch.delenv("FLASHTILE_DECODE_COMBINE")
    assert combine.combine_mode() == "kernel"


def test_merge_tiles():
    """The fused merge's tile: the rows there are (not the tile's padding), the splits
    loaded at once within the register budget; none for V's columns in parts or a
    split's partials past DECODE_MERGE_FP32 a thread."""
    bf16, fp32 = (torch.empty(1, dtype=t, device="meta") for t in (torch.bfloat16,
                                                                   torch.float32))
    tile = configs.TileConfig(16, 64, 4, 3)
    assert configs.decode_merge_tile(bf16, 4, tile, 128) == (4, 16)    # 4 fp32 a thread
    assert configs.decode_merge_tile(bf16, 7, tile, 64) == (8, 16)
    assert configs.decode_merge_tile(bf16, 1, tile, 64) == (1, 16)
    assert configs.decode_merge_tile(fp32, 4, tile, 128) == (4, 1)
    assert configs.decode_merge_tile(fp32, 4, tile, 64) == (4, 2)
    assert configs.decode_merge_tile(bf16, 8, tile, 128) is None
    assert configs.decode_merge_tile(bf16, 4, configs.TileConfig(16, 64, 4, 3, dv_parts=2),
                                     512) is None


# ---- GPU: CUDA graphs and streams ----

def _gpu_case(device, b=1, s=8192, h=32, hkv=8, d=128):
    k_cache, v_cache = (torch.randn(b, s, hkv, d, device=device, dtype=torch.bfloat16)
                        for _ in "kv")
    q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16)
    seqlens = torch.full((b,), s - 5, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, seqlens


@pytest.mark.gpu
def test_fused_decode_replays_in_cuda_graph(device, monkeypatch, launches):
    """A fused split decode (b=1 x 8k keys: 33 splits on an H200) warmed up on one
    stream and captured on torch.cuda.graph's own (PyTorch's recipe: the graph takes the
    device's graph counters), two decodes back to back, replayed three times with new
    queries: equal to the eager call bit for bit, and to the unsplit decode; every
    counter 0 after. A capture needing more counters than any eager call did falls back
    to the combine kernel, still right."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "fused")
    q, k_cache, v_cache, seqlens = _gpu_case(device)

    def step(q=q, seqlens=seqlens):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 num_splits=0, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles, and makes the counters, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
        out, lse = step()
    assert launches == []
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        eager, eager_lse = step()
        assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
        base, base_lse = flashtile.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=1, return_lse=True)
        torch.testing.assert_close(out, base, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    assert all(not c.any() for c in combine._counters.values())
    # 8 sequences: 64 row blocks, past the graph buffer of 1 (no eager call needed more).
    monkeypatch.setattr(combine, "_counters", {})
    monkeypatch.setattr(combine, "MIN_COUNTERS", 1)
    step()
    q8, seqlens8 = q.expand(8, -1, -1, -1).contiguous(), seqlens.expand(8).contiguous()
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "kernel")
    step(q8, seqlens8)  # the combine kernel's variants compile outside the capture
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "fused")
    launches.clear()
    other = torch.cuda.CUDAGraph()
    with torch.cuda.graph(other):
        out8, lse8 = step(q8, seqlens8)
    assert launches
    other.replay()
    eager, eager_lse = step(q8, seqlens8)
    torch.testing.assert_close(out8, eager, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse8, eager_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_fused_decode_is_deterministic_on_two_streams(device, monkeypatch):
    """The split programs finish in whatever order the GPU runs them; the merge reads
    the splits in their order, so 20 calls give one result, bit for bit. Two streams
    decoding at once count on counters of their own."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "fused")
    q, k_cache, v_cache, seqlens = _gpu_case(device, b=2, s=4096)
    first = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                              num_splits=0)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for _ in range(10):
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outs.append(flashtile.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=0))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    streams_counted = {s for d, s in combine._counters
                       if d == torch.cuda.current_device() and s is not None}
    assert {s.cuda_stream for s in streams} < streams_counted
