"""flashtile.kv_cache: the block allocator, fork and copy-on-write, block tables that point
at the right data, the contiguous cache's update, and the errors. Pure PyTorch, CPU."""

from __future__ import annotations

import random
from collections import Counter, deque

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


def _pool_state(cache):
    """Everything free() may change: the free list in order, the counts, the blocks held
    through allocate(), each sequence's blocks and length."""
    return (list(cache._free), list(cache._ref_counts), set(cache._allocated),
            {s: (tuple(q.blocks), q.seqlen) for s, q in cache._seqs.items()})


def test_double_free_raises_and_changes_nothing():
    """Regression: free([b, b]) took the count of b to -1, and later frees passed."""
    cache = _paged(num_blocks=4)
    (b,) = cache.allocate(1)
    before = _pool_state(cache)
    with pytest.raises(ValueError, match=f"^blocks: .*got block {b} listed twice"):
        cache.free([b, b])
    assert _pool_state(cache) == before and cache.ref_count(b) == 1
    cache.free([b])
    with pytest.raises(ValueError, match=f"^blocks: .*got block {b}, which is free"):
        cache.free([b])
    assert cache.ref_count(b) == 0 and cache.num_free_blocks == 4


def test_free_of_a_free_block_raises_and_changes_nothing():
    cache = _paged(num_blocks=4)
    a = cache.allocate(2)
    cache.free([a[0]])
    before = _pool_state(cache)
    with pytest.raises(ValueError, match=f"got block {a[0]}, which is free"):
        cache.free([a[1], a[0]])
    assert _pool_state(cache) == before
    with pytest.raises(ValueError, match="got block 3, which is free"):
        cache.free([3])                                   # never allocated
    for bad in (4, -1):
        with pytest.raises(ValueError, match=f"^blocks: expected block ids 0 to 3, "
                                             f"got block {bad}"):
            cache.free([a[1], bad])
    with pytest.raises(TypeError, match="^blocks: expected int block ids, got float"):
        cache.free([1.0])
    with pytest.raises(TypeError, match="^blocks: expected a sequence of block ids, "
                                        "got int"):
        cache.free(a[1])
    assert _pool_state(cache) == before


def test_free_of_a_sequence_block_raises_and_changes_nothing():
    """A sequence's blocks go back through remove_sequence, never through free()."""
    cache = _paged(num_blocks=4)
    cache.add_sequence("a")
    cache.reserve("a", 20)
    cache.fork("a", "b")
    (mine,) = cache.allocate(1)
    shared = cache.blocks("a")[0]
    before = _pool_state(cache)
    with pytest.raises(ValueError, match=f"got block {shared}, which belongs to sequence "
                                         "'a'.*remove_sequence"):
        cache.free([mine, shared])
    assert _pool_state(cache) == before and cache.ref_count(shared) == 2
    cache.remove_sequence("a")
    cache.remove_sequence("b")
    cache.free([mine])
    assert cache.num_free_blocks == 4


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
# Property test: random operations against a plain-Python model of the pool

class _PoolModel:
    """The pool as plain Python: the free list in the same order (first freed, first
    reused), the blocks each holder has, and each sequence's tokens as an (L, n, HKV, D)
    k and v with NaN where a token was reserved but not written. Reference counts are
    not stored but counted from the holders, so the cache's own counts are checked."""

    def __init__(self, num_blocks, page_size):
        self.num_blocks, self.page = num_blocks, page_size
        self.free = deque(range(num_blocks))
        self.allocated = set()            # blocks held by allocate() callers
        self.seqs = {}                    # seq_id -> [blocks, k, v]

    def count(self, block):
        return (block in self.allocated) + sum(
            blocks.count(block) for blocks, _, _ in self.seqs.values())

    def take(self, n):
        return [self.free.popleft() for _ in range(n)]

    def blocks_needed(self, seq_id, n):
        """(blocks taken from the pool, whether one of them is a copy of the last block)
        for n more tokens: the copy when the last block is partly filled and shared."""
        blocks, k, _ = self.seqs[seq_id]
        copy_last = bool(k.shape[1] % self.page and n and self.count(blocks[-1]) > 1)
        return -(-(k.shape[1] + n) // self.page) - len(blocks) + copy_last, copy_last

    def grow(self, seq_id, new_k, new_v):
        needed, copy_last = self.blocks_needed(seq_id, new_k.shape[1])
        blocks, k, v = self.seqs[seq_id]
        if copy_last:                     # the shared block keeps its other holders
            blocks[-1] = self.take(1)[0]
        blocks += self.take(needed - copy_last)
        self.seqs[seq_id] = [blocks, torch.cat([k, new_k], 1), torch.cat([v, new_v], 1)]

    def remove(self, seq_id):
        blocks = self.seqs.pop(seq_id)[0]
        self.free.extend(b for b in blocks if self.count(b) == 0)


def _full_state(cache):
    return _pool_state(cache), cache.k_cache.clone(), cache.v_cache.clone()


def _check_against_model(cache, model):
    counts = [model.count(b) for b in range(model.num_blocks)]
    assert list(cache._free) == list(model.free)
    assert [cache.ref_count(b) for b in range(model.num_blocks)] == counts
    assert cache._allocated == model.allocated
    # The free list holds each block of count 0 exactly once, and nothing referenced.
    assert sorted(cache._free) == [b for b, c in enumerate(counts) if c == 0]
    assert cache.num_free_blocks == len(model.free)
    assert set(cache._seqs) == set(model.seqs)
    seq_ids = list(model.seqs)
    for s in seq_ids:
        blocks, k, _ = model.seqs[s]
        assert cache.blocks(s) == tuple(blocks) and cache.seqlen(s) == k.shape[1]
        assert len(blocks) == -(-k.shape[1] // model.page)
    # Each sequence reads back the tokens it wrote, whoever shares its blocks.
    plan = cache.plan(seq_ids)
    assert plan.cache_seqlens.tolist() == [cache.seqlen(s) for s in seq_ids]
    for i, s in enumerate(seq_ids):
        _, k, v = model.seqs[s]
        rows = plan.block_table[i, :len(model.seqs[s][0])].long()
        written = ~k[0, :, 0, 0].isnan()
        for pool, truth in ((cache.k_cache, k), (cache.v_cache, v)):
            got = pool[:, rows].flatten(1, 2)[:, :truth.shape[1]]
            assert torch.equal(got[:, written], truth[:, written]), s


def _random_step(cache, model, rng, gen, seen):
    """One random operation, valid or not, on the cache and the model; returns the
    operation's name and the exception type the model predicts (None: it succeeds)."""
    def tokens(n):
        return torch.randn(L, n, HKV, D, generator=gen)

    ids = list(model.seqs)                # ints 0..7; one not in use is unknown
    any_id = rng.choice(ids) if ids and rng.random() < 0.8 else rng.randrange(8)
    op = rng.choice(["allocate", "free", "add", "reserve", "append", "append", "fork",
                     "remove"])
    if op == "allocate":
        n = rng.randint(-1, 4)
        expect = ValueError if n < 0 else CacheFullError if n > len(model.free) else None
        run = lambda: cache.allocate(n)   # noqa: E731
        if expect is None:
            want = model.take(n)
            model.allocated.update(want)
            assert run() == want
            return op, None
        return op, (expect, run)
    if op == "free":
        blocks = rng.sample(sorted(model.allocated), rng.randint(0, len(model.allocated)))
        referenced = [b for b in range(model.num_blocks) if model.count(b)]
        bad = rng.choice([None, None, "twice", "free", "sequence", "range"])
        if bad == "twice" and blocks:
            blocks.append(blocks[0])
        elif bad == "free" and model.free:
            blocks.append(rng.choice(model.free))
        elif bad == "sequence" and set(referenced) - model.allocated:
            blocks.append(rng.choice(sorted(set(referenced) - model.allocated)))
        elif bad == "range":
            blocks.append(rng.choice([-1, model.num_blocks]))
        else:
            bad = None
        rng.shuffle(blocks)
        if bad is None:
            model.allocated.difference_update(blocks)
            model.free.extend(blocks)
            cache.free(blocks)
            return op, None
        return f"free({bad})", (ValueError, lambda: cache.free(blocks))
    if op == "add":
        if any_id in model.seqs:
            return op, (ValueError, lambda: cache.add_sequence(any_id))
        empty = torch.zeros(L, 0, HKV, D)
        model.seqs[any_id] = [[], empty, empty]
        cache.add_sequence(any_id)
        return op, None
    if any_id not in model.seqs:          # every other operation needs a sequence
        calls = {"reserve": lambda: cache.reserve(any_id, 1),
                 "append": lambda: cache.append(any_id, tokens(1), tokens(1)),
                 "fork": lambda: cache.fork(any_id, "other"),
                 "remove": lambda: cache.remove_sequence(any_id)}
        return f"{op}(unknown)", (ValueError, calls[op])
    if op in ("reserve", "append"):
        n = rng.randint(0, 24)
        new_k, new_v = tokens(n), tokens(n)
        if op == "reserve":
            new_k = new_v = torch.full((L, n, HKV, D), float("nan"))
            run = lambda: cache.reserve(any_id, n)    # noqa: E731
        elif rng.random() < 0.1:          # a wrong shape is refused before any change
            return "append(shape)", (ValueError, lambda: cache.append(
                any_id, new_k, tokens(n + 1)))
        else:
            run = lambda: cache.append(any_id, new_k, new_v)    # noqa: E731
        needed, copy_last = model.blocks_needed(any_id, n)
        if needed > len(model.free):
            return f"{op}(full)", (CacheFullError, run)
        seen["copy-on-write"] += copy_last
        model.grow(any_id, new_k, new_v)
        run()
        return op, None
    if op == "fork":
        new_id = rng.randrange(8)
        if new_id in model.seqs:
            return "fork(exists)", (ValueError, lambda: cache.fork(any_id, new_id))
        blocks, k, v = model.seqs[any_id]
        model.seqs[new_id] = [list(blocks), k, v]
        cache.fork(any_id, new_id)
        return op, None
    model.remove(any_id)
    cache.remove_sequence(any_id)
    return op, None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_a_model_of_the_pool(seed):
    """Random allocate/free/add_sequence/reserve/append/fork/remove_sequence, valid and
    invalid, on a small pool (12 blocks of 16 tokens, so it fills up and copy-on-write
    happens often). After each step the cache matches the model: same free list, counts
    equal to the references held, same blocks and lengths per sequence, and every
    written token reads back; a refused operation changed nothing."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cache, model = _paged(num_blocks=12, page_size=16), _PoolModel(12, 16)
    seen = Counter()
    for step in range(600):
        before = _full_state(cache)
        name, refused = _random_step(cache, model, rng, gen, seen)
        if refused is not None:
            expect, run = refused
            with pytest.raises(expect):
                run()
            after = _full_state(cache)
            assert after[0] == before[0], (step, name)
            assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
        seen[name if refused is None else f"refused {name}"] += 1
        _check_against_model(cache, model)
    # The run reached the cases it is meant to test.
    for name in ("allocate", "free", "add", "reserve", "append", "fork", "remove",
                 "copy-on-write", "refused free(twice)", "refused free(free)",
                 "refused free(sequence)", "refused free(range)", "refused append(full)"):
        assert seen[name] > 0, (name, seen)


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
    with pytest.raises(ValueError, match="head_dim: expected 1 to 512, or 576, got 600"):
        KVCache(1, 8, L, HKV, 600)


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
