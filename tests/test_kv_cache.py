"""flashtile.kv_cache: the block allocator, fork and copy-on-write, block tables that point
at the right data, the contiguous cache's update, and the errors. Pure PyTorch, CPU."""

from __future__ import annotations

import random

import pytest
import torch

from flashtile.kv_cache import CacheFullError, KVCache, PagedKVCache, PagedPlan

L, HKV, D = 2, 2, 8   # layers, KV heads, head_dim: small, every test uses them


def _paged(num_blocks=8, page_size=16, dtype=torch.float32):
    return PagedKVCache(num_blocks, page_size, L, HKV, D, dtype=dtype, device="cpu")


def _tokens(n, layers=L, dtype=torch.float32):
    return torch.randn(layers, n, HKV, D, dtype=dtype)


def gather_paged(cache_layer, block_table, cache_seqlens):
    """Pure torch: the paged layer (num_blocks, page_size, h, d) read through block_table
    into one (seqlen_i, h, d) tensor per sequence, as a paged attention kernel reads it."""
    page_size = cache_layer.shape[1]
    out = []
    for row, seqlen in zip(block_table.tolist(), cache_seqlens.tolist()):
        used = -(-seqlen // page_size)
        out.append(cache_layer[row[:used]].flatten(0, 1)[:seqlen])
    return out


# ---------------------------------------------------------------------------------------
# Allocator

def test_allocate_free_and_ref_counts():
    cache = _paged(num_blocks=6)
    a = cache.allocate(4)
    assert len(set(a)) == 4 and cache.num_free_blocks == 2
    assert all(cache.ref_count(b) == 1 for b in a)
    cache.free(a[:2])
    assert cache.num_free_blocks == 4 and cache.ref_count(a[0]) == 0
    assert cache.allocate(0) == []
    b = cache.allocate(4)                       # first freed, first reused
    assert b[2:] == a[:2] and cache.num_free_blocks == 0


def test_free_of_a_free_block_raises_and_changes_nothing():
    cache = _paged(num_blocks=4)
    a = cache.allocate(2)
    cache.free([a[0]])
    with pytest.raises(ValueError, match=f"got block {a[0]}, which is already free"):
        cache.free([a[1], a[0]])
    assert cache.ref_count(a[1]) == 1 and cache.num_free_blocks == 3
    with pytest.raises(ValueError, match="block: expected 0 to 3, got 4"):
        cache.free([4])


def test_exhaustion_raises_cache_full_with_the_numbers():
    cache = _paged(num_blocks=3, page_size=16)
    cache.add_sequence("a")
    cache.append("a", *(_tokens(20),) * 2)               # 2 blocks
    with pytest.raises(CacheFullError) as err:
        cache.reserve("a", 40)                             # 60 tokens: 4 blocks, 2 new
    assert (err.value.blocks_needed, err.value.blocks_free) == (2, 1)
    assert "needs 2 free blocks, 1 of 3 are free" in str(err.value)
    assert "'a'" in str(err.value) and isinstance(err.value, RuntimeError)
    # Nothing changed: same length, same blocks, the free block still free.
    assert cache.seqlen("a") == 20 and len(cache.blocks("a")) == 2
    assert cache.num_free_blocks == 1
    with pytest.raises(CacheFullError, match="allocate\\(2\\) needs 2 free blocks, 1 of 3"):
        cache.allocate(2)


# ---------------------------------------------------------------------------------------
# Sequences, fork, copy-on-write

def test_reserve_returns_slots_and_grows_blocks():
    cache = _paged(num_blocks=4, page_size=16)
    cache.add_sequence(0)
    slots = cache.reserve(0, 18)
    blocks = cache.blocks(0)
    assert len(blocks) == 2 and cache.seqlen(0) == 18
    assert slots[:16] == [(blocks[0], t) for t in range(16)]
    assert slots[16:] == [(blocks[1], 0), (blocks[1], 1)]
    assert cache.reserve(0, 14)[-1] == (blocks[1], 15) and len(cache.blocks(0)) == 2
    assert cache.reserve(0, 1) == [(cache.blocks(0)[2], 0)]


def test_remove_sequence_frees_only_unshared_blocks():
    cache = _paged(num_blocks=8, page_size=16)
    cache.add_sequence("p")
    cache.append("p", *(_tokens(40),) * 2)               # 3 blocks
    cache.fork("p", "c")
    assert all(cache.ref_count(b) == 2 for b in cache.blocks("p"))
    cache.append("c", *(_tokens(30),) * 2)               # 70 tokens: copy of the
    assert cache.num_free_blocks == 8 - 3 - 1 - 2         # partial block, 2 new ones
    cache.remove_sequence("p")
    assert cache.num_free_blocks == 3                     # p's own last block came back
    assert all(cache.ref_count(b) == 1 for b in cache.blocks("c"))
    cache.remove_sequence("c")
    assert cache.num_free_blocks == 8
    with pytest.raises(ValueError, match="seq_id: expected a sequence of the cache"):
        cache.blocks("c")


def test_fork_copy_on_write_keeps_both_sequences_right():
    torch.manual_seed(0)
    cache = _paged(num_blocks=10, page_size=16)
    prefix_k, prefix_v = _tokens(21), _tokens(21)         # 1 full block + 5 tokens
    cache.add_sequence("parent")
    cache.append("parent", prefix_k, prefix_v)
    cache.fork("parent", "child")
    shared_last = cache.blocks("parent")[-1]
    assert cache.blocks("child") == cache.blocks("parent")
    assert cache.ref_count(shared_last) == 2

    child_k, child_v = _tokens(3), _tokens(3)
    cache.append("child", child_k, child_v)               # into the shared partial block
    assert cache.blocks("child")[0] == cache.blocks("parent")[0]   # full block: shared
    assert cache.blocks("child")[1] != shared_last                 # partial: copied
    assert cache.ref_count(shared_last) == 1
    parent_k, parent_v = _tokens(4), _tokens(4)
    cache.append("parent", parent_k, parent_v)            # parent owns its block again
    assert cache.blocks("parent")[1] == shared_last

    plan = cache.plan(["parent", "child"])
    for layer in range(L):
        got_k = gather_paged(cache.k_cache[layer], plan.block_table, plan.cache_seqlens)
        got_v = gather_paged(cache.v_cache[layer], plan.block_table, plan.cache_seqlens)
        assert torch.equal(got_k[0], torch.cat([prefix_k[layer], parent_k[layer]]))
        assert torch.equal(got_v[0], torch.cat([prefix_v[layer], parent_v[layer]]))
        assert torch.equal(got_k[1], torch.cat([prefix_k[layer], child_k[layer]]))
        assert torch.equal(got_v[1], torch.cat([prefix_v[layer], child_v[layer]]))


def test_fork_at_a_block_boundary_copies_nothing():
    cache = _paged(num_blocks=4, page_size=16)
    cache.add_sequence(1)
    cache.append(1, *(_tokens(16),) * 2)
    cache.fork(1, 2)
    cache.reserve(2, 1)
    assert cache.blocks(2)[0] == cache.blocks(1)[0] and len(cache.blocks(2)) == 2
    assert cache.num_free_blocks == 2


def test_sequence_id_errors():
    cache = _paged()
    cache.add_sequence("x")
    with pytest.raises(ValueError, match="seq_id: expected a new sequence id, got 'x'"):
        cache.add_sequence("x")
    with pytest.raises(ValueError, match="new_seq_id: expected a new sequence id, got 'x'"):
        cache.fork("x", "x")
    with pytest.raises(ValueError, match="seq_id: expected a sequence of the cache.*'y'"):
        cache.reserve("y", 1)


# ---------------------------------------------------------------------------------------
# Block tables point at the right data

@pytest.mark.parametrize("page_size", [16, 32])
def test_block_table_gathers_the_written_tokens(page_size):
    """Several sequences written in interleaved chunks into a pool whose free list was
    shuffled; reading the pool through block_table gives back each sequence's tokens."""
    rng = random.Random(0)
    num_blocks = 24
    cache = _paged(num_blocks=num_blocks, page_size=page_size)
    order = list(range(num_blocks))
    rng.shuffle(order)
    taken = cache.allocate(num_blocks)
    cache.free([taken[i] for i in order])                 # free list is now `order`

    seqlens = {"s0": 1, "s1": 37, "s2": 2 * page_size, "s3": 70}
    truth = {s: _tokens(n) for s, n in seqlens.items()}   # (L, n, h, d) per sequence
    truth_v = {s: _tokens(n) for s, n in seqlens.items()}
    written = dict.fromkeys(seqlens, 0)
    for s in seqlens:
        cache.add_sequence(s)
    while any(written[s] < seqlens[s] for s in seqlens):   # interleave, random chunks
        s = rng.choice([s for s in seqlens if written[s] < seqlens[s]])
        n = min(rng.randint(1, 20), seqlens[s] - written[s])
        cache.reserve(s, n)
        for layer in range(L):
            cache.write(layer, s, truth[s][layer, written[s]:written[s] + n],
                        truth_v[s][layer, written[s]:written[s] + n])
        written[s] += n

    seq_ids = ["s3", "s0", "s2", "s1"]
    plan = cache.plan(seq_ids)
    assert isinstance(plan, PagedPlan)
    assert plan.block_table.dtype == plan.cache_seqlens.dtype == torch.int32
    assert plan.cache_seqlens.tolist() == [seqlens[s] for s in seq_ids]
    assert plan.max_seqlen == 70
    width = -(-70 // page_size)
    assert plan.block_table.shape == (4, width)
    assert torch.equal(plan.block_table, cache.block_table(seq_ids))
    assert torch.equal(plan.cache_seqlens, cache.cache_seqlens(seq_ids))
    # Blocks went out in the shuffled free-list order, not 0, 1, 2, ...
    used = [b for s in seqlens for b in cache.blocks(s)]
    assert sorted(used) == sorted(order[:len(used)]) and order != sorted(order)
    for i, s in enumerate(seq_ids):                        # padding is 0
        used = len(cache.blocks(s))
        assert (plan.block_table[i, used:] == 0).all()
    for layer in range(L):
        got_k = gather_paged(cache.k_cache[layer], plan.block_table, plan.cache_seqlens)
        got_v = gather_paged(cache.v_cache[layer], plan.block_table, plan.cache_seqlens)
        for i, s in enumerate(seq_ids):
            assert torch.equal(got_k[i], truth[s][layer]), (s, layer)
            assert torch.equal(got_v[i], truth_v[s][layer]), (s, layer)


def test_block_table_fixed_width_and_its_error():
    cache = _paged(page_size=16)
    cache.add_sequence(0)
    cache.reserve(0, 33)                                   # 3 blocks
    assert cache.block_table([0], max_blocks_per_seq=5).shape == (1, 5)
    with pytest.raises(ValueError, match="max_blocks_per_seq: expected an int >= 3, got 2"):
        cache.block_table([0], max_blocks_per_seq=2)
    cache.add_sequence(1)
    assert cache.block_table([1]).shape == (1, 1)          # empty sequence: width 1


def test_write_checks_shape_dtype_and_device():
    cache = _paged()
    cache.add_sequence(0)
    cache.reserve(0, 3)
    k = torch.randn(3, HKV, D)
    with pytest.raises(ValueError, match=r"k.shape: expected \(3, nheads_kv=2, "
                                         r"head_dim=8\), got \(2, 2, 8\)"):
        cache.write(0, 0, k[:2], k[:2])
    with pytest.raises(TypeError, match="v.dtype: expected the cache's dtype "
                                        "torch.float32"):
        cache.write(0, 0, k, k.half())
    with pytest.raises(ValueError, match="k.device: expected the cache's device cpu, "
                                         "got meta"):
        cache.write(0, 0, k.to("meta"), k)
    with pytest.raises(ValueError, match="layer: expected 0 to 1, got 2"):
        cache.write(2, 0, k, k)
    with pytest.raises(ValueError, match=r"len\(layer_k\): expected num_layers=2, got 1"):
        cache.append(0, [k], [k, k])


@pytest.mark.parametrize("page_size", [0, 8, 24, 100, 512, -16])
def test_page_size_must_be_a_power_of_two_in_16_256(page_size):
    with pytest.raises(ValueError, match=f"page_size: expected a power of two from 16 to "
                                         f"256, got {page_size}"):
        _paged(page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_page_size_accepted(page_size):
    assert _paged(num_blocks=2, page_size=page_size).k_cache.shape == \
        (L, 2, page_size, HKV, D)


def test_constructor_errors():
    with pytest.raises(TypeError, match="page_size: expected an int, got float"):
        PagedKVCache(4, 16.0, L, HKV, D)
    with pytest.raises(ValueError, match="num_blocks: expected an int >= 1, got 0"):
        PagedKVCache(0, 16, L, HKV, D)
    with pytest.raises(TypeError, match="dtype: expected torch.float16, torch.bfloat16 or "
                                        "torch.float32, got torch.int8"):
        KVCache(1, 8, L, HKV, D, dtype=torch.int8)
    with pytest.raises(ValueError, match="head_dim: expected 1 to 256, got 300"):
        KVCache(1, 8, L, HKV, 300)


# ---------------------------------------------------------------------------------------
# Contiguous cache

def test_kv_cache_update_with_int_start_and_tensor_positions():
    cache = KVCache(max_batch=3, max_seqlen=10, num_layers=L, nheads_kv=HKV, head_dim=D,
                    dtype=torch.float32)
    prompt_k, prompt_v = torch.randn(2, 6, HKV, D), torch.randn(2, 6, HKV, D)
    k_layer, v_layer = cache.update(1, 0, prompt_k, prompt_v)        # prefill
    assert k_layer.shape == (2, 10, HKV, D)
    assert torch.equal(k_layer[:, :6], prompt_k) and torch.equal(v_layer[:, :6], prompt_v)
    assert cache.cache_seqlens.tolist() == [6, 6, 0]
    assert (cache.k_cache[0] == 0).all()                     # other layer untouched

    step_k, step_v = torch.randn(2, 1, HKV, D), torch.randn(2, 1, HKV, D)
    cache.update(1, torch.tensor([6]), step_k, step_v)               # decode, gpt-fast
    assert torch.equal(cache.k_cache[1, :2, 6], step_k[:, 0])
    assert torch.equal(cache.v_cache[1, :2, 6], step_v[:, 0])
    assert cache.cache_seqlens.tolist() == [7, 7, 0]
    cache.reset()
    assert cache.cache_seqlens.tolist() == [0, 0, 0]


def test_kv_cache_overflow_raises_before_writing():
    cache = KVCache(2, 8, L, HKV, D, dtype=torch.float32)
    k = torch.randn(2, 3, HKV, D)
    with pytest.raises(ValueError, match=r"input_pos \+ n_new: expected at most "
                                         r"max_seqlen=8, got 6 \+ 3 = 9"):
        cache.update(0, 6, k, k)
    with pytest.raises(ValueError, match=r"input_pos: expected positions in \[0, "
                                         r"max_seqlen=8\), got positions from 6 to 8"):
        cache.update(0, torch.tensor([6, 7, 8]), k, k)
    with pytest.raises(ValueError, match="got positions from -1 to 1"):
        cache.update(0, torch.tensor([-1, 0, 1]), k, k)
    assert (cache.k_cache == 0).all() and cache.cache_seqlens.tolist() == [0, 0]


def test_kv_cache_input_errors():
    cache = KVCache(2, 8, L, HKV, D, dtype=torch.float32)
    k = torch.randn(2, 3, HKV, D)
    with pytest.raises(ValueError, match=r"k.shape\[0\] \(batch\): expected at most "
                                         "max_batch=2, got 3"):
        cache.update(0, 0, torch.randn(3, 3, HKV, D), torch.randn(3, 3, HKV, D))
    with pytest.raises(TypeError, match="input_pos.dtype: expected torch.int64 or "
                                        "torch.int32, got torch.float32"):
        cache.update(0, torch.tensor([0.0, 1.0, 2.0]), k, k)
    with pytest.raises(ValueError, match=r"input_pos.shape: expected \(n_new,\) = \(3,\)"):
        cache.update(0, torch.tensor([0, 1]), k, k)
    with pytest.raises(ValueError, match=r"k.shape: expected \(batch, n_new, nheads_kv=2, "
                                         r"head_dim=8\), got \(2, 3, 4, 8\)"):
        cache.update(0, 0, torch.randn(2, 3, 4, D), k)
    with pytest.raises(TypeError, match="k.dtype: expected the cache's dtype"):
        cache.update(0, 0, k.half(), k)
