"""Index tensors are not read on the host by default (issue 15): a bad index is harmless
and visible, never an access outside a tensor nor a plausible number.

cu_seqlens_q/k, seqused_k, block_table, cache_seqlens, cache_batch_idx and
cache_leftpad live on the device; reading them back would be a sync per call. The
kernels check what they read instead: prefix sums that are not valid make every row NaN
(out, lse and the gradients); a sequence whose key count, left pad or cache row is out
of range has NaN rows and reads nothing; a block-table entry outside the pool is never
followed, and the rows that would see its keys are NaN. ``flashtile.set_index_checks``
(tests: the ``index_checks`` fixture) restores the host check and its ValueError; the
PyTorch path always checks. The lead runs this file under compute-sanitizer (make
memcheck): the bad indices here must cause no out-of-bounds access on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flashtile
from tests.conftest import triton_available_here
from tests.utils import max_err

# The interpreter's numpy max over a row of NaN warns; the NaN is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

H, HKV, D = 4, 2, 16


@pytest.fixture
def triton(monkeypatch, on_gpu):
    """The Triton kernels: on the GPU, or through the interpreter on CPU."""
    if not triton_available_here(on_gpu):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")


@pytest.fixture
def dtype(on_gpu):
    return torch.float16 if on_gpu else torch.float32


def _cu(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _all_nan(*xs):
    return all(bool(torch.isnan(x).all()) for x in xs)


def _finite(*xs):
    return all(bool(torch.isfinite(x).all()) for x in xs)


# ---- packed varlen: cu_seqlens_q/k and max_seqlen_q/k ----

LENGTHS = ([4, 3, 6], [5, 7, 2])  # queries and keys of three sequences: 13 and 14 rows
# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) that are not valid.
BAD_PREFIX_SUMS = {
    "q_decreasing": ([0, 9, 7, 13], [0, 5, 12, 14], 6, 7),
    "q_short_of_total": ([0, 4, 7, 12], [0, 5, 12, 14], 6, 7),
    "q_past_total": ([0, 4, 7, 40], [0, 5, 12, 14], 6, 7),
    "q_negative": ([-3, 4, 7, 13], [0, 5, 12, 14], 6, 7),
    "q_huge": ([0, 4, 7, 2**31 - 1], [0, 5, 12, 14], 6, 7),
    "q_longer_than_max": ([0, 4, 7, 13], [0, 5, 12, 14], 5, 7),
    "q_max_zero": ([0, 4, 7, 13], [0, 5, 12, 14], 0, 7),
    "k_decreasing": ([0, 4, 7, 13], [0, 12, 5, 14], 6, 7),
    "k_past_total": ([0, 4, 7, 13], [0, 5, 12, 99], 6, 7),
    "k_longer_than_max": ([0, 4, 7, 13], [0, 5, 12, 14], 6, 6),
}


def _packed(device, dtype, requires_grad=False):
    q = torch.randn(13, H, D, device=device, dtype=dtype)
    k, v = (torch.randn(14, HKV, D, device=device, dtype=dtype) for _ in "kv")
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


@pytest.mark.parametrize("bwd", ["split", "fused"])
@pytest.mark.parametrize("case", list(BAD_PREFIX_SUMS))
def test_bad_index_varlen_prefix_sums_make_every_row_nan(case, bwd, triton, device, dtype,
                                                         monkeypatch):
    """Both Triton backwards: the fused one's dq comes from an accumulator that the
    kernel fills with NaN instead of adding to it."""
    monkeypatch.setenv("FLASHTILE_BWD", bwd)
    cu_q, cu_k, max_q, max_k = BAD_PREFIX_SUMS[case]
    q, k, v = _packed(device, dtype, requires_grad=True)
    out, lse = flashtile.flash_attn_varlen_func(
        q, k, v, _cu(cu_q, device), _cu(cu_k, device), max_q, max_k, causal=True,
        return_lse=True)
    assert _all_nan(out, lse)
    out.float().sum().backward()
    assert _all_nan(q.grad, k.grad, v.grad)


def test_bad_index_varlen_valid_prefix_sums_stay_exact(triton, device, dtype):
    """The check passes valid prefix sums through unchanged: equal to each sequence
    computed alone (empty sequences included)."""
    q, k, v = _packed(device, dtype)
    cu_q, cu_k = _cu([0, 4, 4, 13], device), _cu([0, 5, 12, 14], device)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 7, causal=True)
    assert _finite(out)
    for (qs, qe), (ks, ke) in zip([(0, 4), (4, 4), (4, 13)], [(0, 5), (5, 12), (12, 14)]):
        ref = flashtile.flash_attn_func(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                        causal=True)[0]
        assert max_err(out[qs:qe], ref) < (2e-3 if dtype == torch.float16 else 1e-5)


def test_bad_index_varlen_no_sequence_with_rows_is_a_shape_error(device):
    """cu_seqlens of one entry (no sequence) while q has rows is known from the shapes:
    a ValueError whether or not the index checks are on."""
    q, k, v = _packed(device, torch.float32)
    zero = _cu([0], device)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected prefix sums from 0"):
        flashtile.flash_attn_varlen_func(q, k, v, zero, zero, 0, 0)


@pytest.mark.parametrize("value", [-1, 2**31], ids=["negative", "past_int32"])
def test_max_seqlen_range_is_checked_without_a_read(value, device):
    q, k, v = _packed(device, torch.float32)
    cu_q, cu_k = _cu([0, 4, 7, 13], device), _cu([0, 5, 12, 14], device)
    with pytest.raises(ValueError, match="max_seqlen_q: expected an int from 0 to"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, value, 7)


# ---- paged varlen: block_table, seqused_k, the key counts ----

PAGE = 16


def _paged(device, dtype):
    """Two sequences, 4 and 5 new queries over 20 and 33 keys, in a pool of 6 pages
    laid out in order (sequence 0: pages 0-1, sequence 1: pages 2-4, page 5 unused)."""
    gen = torch.Generator().manual_seed(1)
    pool_k, pool_v = (torch.randn(6, PAGE, HKV, D, generator=gen).to(device, dtype)
                      for _ in "kv")
    q = torch.randn(9, H, D, generator=gen).to(device, dtype)
    table = _cu([[0, 1, 0], [2, 3, 4]], device)
    return dict(q=q, k=pool_k, v=pool_v, cu_seqlens_q=_cu([0, 4, 9], device),
                cu_seqlens_k=_cu([0, 20, 53], device), max_seqlen_q=5, max_seqlen_k=33,
                block_table=table, causal=True)


def _paged_run(args):
    with torch.no_grad():
        return flashtile.flash_attn_varlen_func(**args, return_lse=True)


@pytest.mark.parametrize("entry", [6, -1, 2**31 - 1, -2**31],
                         ids=["past_pool", "negative", "int32_max", "int32_min"])
@pytest.mark.parametrize("page", [0, 2], ids=["first_page", "last_page"])
def test_bad_index_paged_varlen_block_table_entry(entry, page, triton, device, dtype):
    """A bad entry in sequence 1's pages: the rows that see its keys are NaN (other rows
    of their block of queries may be NaN too, never another number), sequence 0 is
    untouched. Causal with 5 queries over the last of 33 keys: every row sees page 0's
    keys; page 2 (keys 32..) only the last query, which sits at key 32."""
    args = _paged(device, dtype)
    good_out, good_lse = _paged_run(args)
    args["block_table"] = args["block_table"].clone()
    args["block_table"][1, page] = entry
    out, lse = _paged_run(args)
    assert torch.equal(out[:4], good_out[:4]) and torch.equal(lse[:, :4], good_lse[:, :4])
    rows = slice(4, 9) if page == 0 else slice(8, 9)
    assert _all_nan(out[rows], lse[:, rows])
    for r in range(4, 8):
        assert _all_nan(out[r]) or torch.equal(out[r], good_out[r])


def test_bad_index_paged_varlen_entries_past_the_keys_are_never_followed(triton, device,
                                                                         dtype):
    """Table entries past a sequence's pages may hold anything (vLLM pads with -1)."""
    args = _paged(device, dtype)
    good = _paged_run(args)
    args["block_table"] = args["block_table"].clone()
    args["block_table"][0, 2] = -1
    for got, want in zip(_paged_run(args), good):
        assert torch.equal(got, want)


@pytest.mark.parametrize("change", ["seqused_past_table", "seqused_negative",
                                    "keys_negative", "keys_past_table"])
def test_bad_index_paged_varlen_key_count(change, triton, device, dtype):
    """Sequence 1's key count outside [0, 3 pages * 16]: its rows are NaN and read
    nothing; sequence 0 is untouched."""
    args = _paged(device, dtype)
    good_out, _ = _paged_run(args)
    if change.startswith("seqused"):
        args["seqused_k"] = _cu([20, 49 if change == "seqused_past_table" else -5], device)
    else:
        args["cu_seqlens_k"] = _cu([0, 20, 7 if change == "keys_negative" else 69], device)
    out, lse = _paged_run(args)
    assert torch.equal(out[:4], good_out[:4])
    assert _all_nan(out[4:], lse[:, 4:])


@pytest.mark.parametrize("cu_q", [[0, 4, 8], [0, 6, 9], [0, 4, 30]],
                         ids=["short_of_total", "longer_than_max", "past_total"])
def test_bad_index_paged_varlen_query_prefix_sums(cu_q, triton, device, dtype):
    args = _paged(device, dtype)
    args["cu_seqlens_q"] = _cu(cu_q, device)
    assert _all_nan(*_paged_run(args))


# ---- flash_attn_with_kvcache: cache_seqlens, cache_batch_idx, cache_leftpad, pages ----

def _cache(device, dtype, paged):
    """Two sequences, capacity 48 keys each: a contiguous (2, 48) cache, or pages of 16
    (sequence 0: pages 0-2, sequence 1: pages 3-5, pages 6-7 spare)."""
    gen = torch.Generator().manual_seed(2)
    if paged:
        k_cache, v_cache = (torch.randn(8, PAGE, HKV, D, generator=gen).to(device, dtype)
                            for _ in "kv")
        extra = dict(block_table=_cu([[0, 1, 2], [3, 4, 5]], device))
    else:
        k_cache, v_cache = (torch.randn(2, 48, HKV, D, generator=gen).to(device, dtype)
                            for _ in "kv")
        extra = {}
    q = torch.randn(2, 1, H, D, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, extra


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen", [49, -1, 2**31 - 1], ids=["past_capacity", "negative",
                                                             "int32_max"])
def test_bad_index_kvcache_seqlens(seqlen, paged, num_splits, triton, device, dtype):
    q, k_cache, v_cache, extra = _cache(device, dtype, paged)
    kw = dict(causal=True, num_splits=num_splits, return_lse=True, **extra)
    good_out, good_lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=_cu([30, 40], device), **kw)
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=_cu([30, seqlen], device), **kw)
    assert torch.equal(out[0], good_out[0]) and torch.equal(lse[0], good_lse[0])
    assert _all_nan(out[1], lse[1])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_bad_index_kvcache_append_past_capacity_writes_nothing(paged, triton, device,
                                                                dtype):
    """Sequence 1 has 46 keys and 3 new ones would end past its 48: nothing of it is
    written and its rows are NaN; sequence 0 appends and attends as usual."""
    q, k_cache, v_cache, extra = _cache(device, dtype, paged)
    k_new, v_new = (torch.randn(2, 3, HKV, D, device=device, dtype=dtype) for _ in "kv")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=_cu([10, 46], device),
        causal=True, return_lse=True, **extra)
    assert _all_nan(out[1], lse[1]) and _finite(out[0], lse[0])
    if paged:
        assert torch.equal(k_cache[0][10:13], k_new[0]) and torch.equal(k_cache[3:6],
                                                                         before_k[3:6])
        assert torch.equal(v_cache[3:6], before_v[3:6])
    else:
        assert torch.equal(k_cache[0, 10:13], k_new[0])
        assert torch.equal(k_cache[1], before_k[1]) and torch.equal(v_cache[1], before_v[1])


@pytest.mark.parametrize("entry", [8, -1], ids=["past_pool", "negative"])
def test_bad_index_kvcache_block_table(entry, triton, device, dtype):
    """A bad entry among sequence 1's pages makes its rows NaN (a decode row sees every
    key); its appended token, which would go to that page, is written nowhere; an
    entry past sequence 0's keys is never followed."""
    q, k_cache, v_cache, extra = _cache(device, dtype, paged=True)
    table = extra["block_table"].clone()
    table[1, 2] = entry   # sequence 1 has 40 keys: page 2 holds keys 32..
    table[0, 2] = entry   # sequence 0 has 30 keys: page 2 is past them
    k_new, v_new = (torch.randn(2, 1, HKV, D, device=device, dtype=dtype) for _ in "kv")
    before = k_cache.clone()
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=_cu([29, 39], device),
        block_table=table, causal=True, return_lse=True)
    assert _finite(out[0], lse[0]) and _all_nan(out[1], lse[1])
    others = [0, *range(2, 8)]  # sequence 0 appends at key 29: page 1, row 13
    assert torch.equal(k_cache[others], before[others])
    assert torch.equal(k_cache[1, 13], k_new[0, 0])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("change", ["batch_idx_past_cache", "batch_idx_negative",
                                    "leftpad_past_seqlen", "leftpad_negative"])
def test_bad_index_kvcache_batch_idx_and_leftpad(change, num_splits, triton, device,
                                                 dtype):
    q, k_cache, v_cache, _ = _cache(device, dtype, paged=False)
    good = dict(cache_batch_idx=_cu([1, 0], device), cache_leftpad=_cu([2, 5], device))
    bad = dict(good)
    if change.startswith("batch_idx"):
        bad["cache_batch_idx"] = _cu([1, 2 if change.endswith("cache") else -1], device)
    else:
        bad["cache_leftpad"] = _cu([2, 41 if change.endswith("seqlen") else -3], device)
    kw = dict(cache_seqlens=_cu([30, 40], device), num_splits=num_splits, return_lse=True)
    good_out, good_lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **good, **kw)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **bad, **kw)
    assert torch.equal(out[0], good_out[0]) and torch.equal(lse[0], good_lse[0])
    assert _all_nan(out[1], lse[1])


def test_bad_index_kvcache_rotary_table_too_short(triton, device, dtype):
    """Positions past the rotary table rotate their tokens to NaN: sequence 1 (keys
    15.., table of 16 rows) is NaN, its appended key too; sequence 0 is rotated."""
    q, k_cache, v_cache, _ = _cache(device, dtype, paged=False)
    k_new, v_new = (torch.randn(2, 1, HKV, D, device=device, dtype=dtype) for _ in "kv")
    cos, sin = (torch.rand(16, 4, device=device, dtype=dtype) for _ in "cs")
    out = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=_cu([3, 20], device), causal=True)
    assert _finite(out[0]) and _all_nan(out[1])
    assert torch.isnan(k_cache[1, 20, :, :8]).all() and _finite(k_cache[0, 3])


def test_bad_index_kvcache_compiled_is_nan(triton, device, dtype):
    """The compiled op follows the same rule: no host read, NaN rows."""
    torch._dynamo.reset()
    q, k_cache, v_cache, _ = _cache(device, dtype, paged=False)
    step = torch.compile(lambda q, s: flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=s), fullgraph=True)
    out = step(q, _cu([30, 49], device))
    assert _finite(out[0]) and _all_nan(out[1])


# ---- the host check: opt in, always on the PyTorch path ----

def test_index_checks_raise_instead(triton, device, index_checks):
    q, k_cache, v_cache, _ = _cache(device, torch.float32, paged=False)
    with pytest.raises(ValueError, match="cache_seqlens: expected values in"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                          cache_seqlens=_cu([30, 49], device))
    q, k, v = _packed(device, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing prefix"):
        flashtile.flash_attn_varlen_func(q, k, v, _cu([0, 9, 7, 13], device),
                                         _cu([0, 5, 12, 14], device), 6, 7)


def test_torch_path_always_checks(monkeypatch, on_gpu):
    if on_gpu:
        pytest.skip("the PyTorch path runs CPU tensors")
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    assert not flashtile.set_index_checks(False)
    q, k_cache, v_cache, _ = _cache("cpu", torch.float32, paged=False)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                          cache_seqlens=_cu([30, 49], "cpu"))
    q, k, v = _packed("cpu", torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flashtile.flash_attn_varlen_func(q, k, v, _cu([0, 4, 7, 13], "cpu"),
                                         _cu([0, 12, 5, 14], "cpu"), 6, 7)


def test_set_index_checks_returns_the_previous_setting():
    assert flashtile.set_index_checks(True) is False
    assert flashtile.set_index_checks(False) is True
    with pytest.raises(TypeError, match="enabled: expected a bool"):
        flashtile.set_index_checks("yes")


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False)])
def test_index_checks_environment_variable(value, expected):
    env = dict(os.environ, FLASHTILE_CHECK_INDICES=value)
    code = "import flashtile._validate as V; print(V.index_checks_enabled())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__))))
    assert result.stdout.strip() == str(expected)


@pytest.mark.gpu
def test_window_size_on_the_gpu_is_refused(device):
    q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="window_size: expected a pair of ints"):
        flashtile.flash_attn_func(q, q, q, window_size=torch.tensor([2, 0], device=device))
    flashtile.flash_attn_func(q, q, q, window_size=torch.tensor([2, 0]))
