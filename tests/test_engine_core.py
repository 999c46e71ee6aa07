"""The engine's host-side core: SamplingParams, Sequence, BlockManager, Sampler.

All CPU and fast: these are Python and plain torch, no Triton.
"""

import math

import pytest

from flashtile.engine.block_manager import BlockManager
from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.sequence import Sequence, SequenceStatus


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(n=2), ValueError, "n: expected 1"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=math.nan), ValueError, "temperature: expected a finite"),
    (dict(temperature=math.inf), ValueError, "temperature: expected a finite"),
    (dict(temperature="hot"), TypeError, "temperature: expected a float"),
    (dict(top_p=0.0), ValueError, "top_p: expected a number in (0, 1]"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k: expected an int"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(min_p=1.1), ValueError, "min_p"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
    (dict(seed=True), TypeError, "seed: expected an int or None"),
    (dict(seed="1"), TypeError, "seed"),
    (dict(stop=[""]), ValueError, "stop[0]"),
    (dict(stop=["a", 3]), TypeError, "stop[1]"),
    (dict(stop_token_ids=[1, -1]), ValueError, "stop_token_ids[1]"),
    (dict(stop_token_ids="2"), TypeError, "stop_token_ids"),
    (dict(max_tokens=0), ValueError, "max_tokens: expected an int >= 1"),
    (dict(max_tokens=1.0), TypeError, "max_tokens"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(ignore_eos=1), TypeError, "ignore_eos: expected a bool"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_sampling_params_rejects(kwargs, exc, words):
    with pytest.raises(exc) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)
    # the message names what was given too
    assert "got" in str(info.value)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == \
        (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 7)).stop_token_ids == [2, 7]
    assert SamplingParams(temperature=0).greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(max_tokens=None, top_k=0, logprobs=0).max_tokens is None


# ---------------------------------------------------------------- Sequence

def test_sequence_accounting():
    p = SamplingParams(max_tokens=4)
    a, b = Sequence([5, 6, 7], p, arrival_time=1.0), Sequence([1])
    assert b.seq_id > a.seq_id  # arrival order, used to pick whom to preempt
    assert a.status is SequenceStatus.WAITING and a.sampling_params is p
    assert (a.num_tokens, a.num_prompt_tokens, a.num_computed_tokens) == (3, 3, 0)
    assert a.num_blocks(2) == 2 and a.num_blocks(3) == 1 and a.num_blocks(16) == 1
    assert a.first_token_time is None
    a.append_token(9, logprob=-0.5)
    a.append_token(4)
    assert a.token_ids == [5, 6, 7, 9, 4] and a.last_token == 4 and len(a) == 5
    assert a.prompt_token_ids == [5, 6, 7] and a.completion_token_ids == [9, 4]
    assert a.num_completion_tokens == 2 and a.output_logprobs == [-0.5]
    assert a.first_token_time >= a.arrival_time
    a.finish("length")
    assert a.is_finished and a.finish_reason == "length" and a.finish_time is not None
    with pytest.raises(ValueError, match="reason"):
        a.finish("done")
    with pytest.raises(ValueError, match="token_ids: expected a non-empty prompt"):
        Sequence([])


# ---------------------------------------------------------------- BlockManager

def _run(bm, seq, n):
    """Compute n more tokens of seq as a step would: pages for them, KV written, commit."""
    assert bm.ensure_slots(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


def test_block_manager_prefix_hit_reuses_pages():
    bm = BlockManager(num_blocks=10, page_size=4)
    a = Sequence(list(range(10)))                        # 2 full pages + 2 tokens
    assert bm.allocate(a) and a.num_cached_tokens == 0 and len(a.block_table) == 3
    assert bm.num_free_blocks == 7
    _run(bm, a, 10)
    b = Sequence(list(range(8)) + [99, 98, 97])         # shares a's 2 full pages
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    shared = a.block_table[:2]
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == 10 and bm.usage() == 0.0
    assert b.block_table == [] and b.num_computed_tokens == 0
    # Freed pages keep their contents: the same prompt hits them again.
    c = Sequence(list(range(10)))
    assert bm.allocate(c) and c.block_table[:2] == shared


def test_block_manager_never_caches_the_last_token():
    bm = BlockManager(num_blocks=8, page_size=4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    _run(bm, a, 8)
    # The same 8 tokens: the second page holds the last token, so only the first hits.
    b = Sequence(list(range(8)))
    assert bm.allocate(b) and b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    c = Sequence(list(range(4)))                        # one page: nothing may hit
    assert bm.allocate(c) and c.num_cached_tokens == 0


def test_block_manager_short_pool_changes_nothing():
    bm = BlockManager(num_blocks=3, page_size=2)
    a = Sequence([1, 2, 3, 4, 5])                       # 3 pages
    b = Sequence([7])
    assert bm.allocate(a)
    assert not bm.can_allocate(b) and not bm.allocate(b)
    assert b.block_table == [] and bm.num_free_blocks == 0
    a.num_computed_tokens = 5
    table = list(a.block_table)
    assert not bm.ensure_slots(a, 2)                    # a 4th page is needed
    assert a.block_table == table and bm.num_free_blocks == 0
    assert bm.usage() == 1.0
    bm.check_invariants()
    with pytest.raises(ValueError, match="seq.block_table"):
        bm.allocate(a)
    with pytest.raises(ValueError, match="seq: expected a sequence allocated"):
        bm.ensure_slots(b, 1)


def test_block_manager_evicts_least_recently_freed_cached_pages():
    bm = BlockManager(num_blocks=6, page_size=2)
    a, b = Sequence([1, 1, 1, 1, 1]), Sequence([2, 2, 2, 2, 2])
    for s in (a, b):
        bm.allocate(s)
        _run(bm, s, 5)
    (a0, a1, a2), (b0, b1, b2) = a.block_table, b.block_table
    bm.free(a)
    bm.free(b)
    # Reuse order: the partial pages (nothing cached), then cached pages least recently
    # freed first, a sequence's tail before its head: a1, a0, b1, b0.
    new = Sequence([3, 3, 3, 3, 3])
    assert bm.allocate(new) and new.block_table == [b2, a2, a1]
    bm.check_invariants()
    again_b = Sequence([2, 2, 2, 2, 2])
    assert bm.allocate(again_b) and again_b.num_cached_tokens == 4
    assert again_b.block_table == [b0, b1, a0]          # a's head page is evicted last
    assert bm.num_free_blocks == 0
    again_a = Sequence([1, 1, 1, 1, 1])
    assert not bm.allocate(again_a)
    bm.free(new)
    assert bm.allocate(again_a) and again_a.num_cached_tokens == 0  # a's pages are gone
    bm.check_invariants()


def test_block_manager_without_prefix_caching():
    bm = BlockManager(num_blocks=6, page_size=2, enable_prefix_caching=False)
    a, b = Sequence([1, 2, 3]), Sequence([1, 2, 3])
    for s in (a, b):
        assert bm.allocate(s)
        _run(bm, s, 3)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)


@pytest.mark.parametrize("kwargs", [dict(num_blocks=0, page_size=16),
                                    dict(num_blocks=4, page_size=16.0),
                                    dict(num_blocks=True, page_size=16)])
def test_block_manager_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="expected an int >= 1"):
        BlockManager(**kwargs)


def _weak_hash(parent_hash, token_ids):
    """Collides all the time, to exercise the guards behind the hash."""
    return (sum(token_ids) + (parent_hash or 0)) % 5


def _parentless_hash(parent_hash, token_ids):
    """Forgets the chain: equal pages at different places collide."""
    return hash(tuple(token_ids))


@pytest.mark.parametrize("hash_kind", ["xxhash", "hashlib", "weak"])
@pytest.mark.parametrize("page_size", [1, 2, 3])
def test_block_manager_random_schedule(monkeypatch, hash_kind, page_size):
    """Random admissions, chunked steps, decodes, preemptions and finishes against a model
    of the pool: every slot remembers the token prefix whose KV was written into it, so
    any page handed to the wrong sequence, overwritten while shared or evicted while in
    use shows as a sequence whose computed tokens are not its own."""
    import random

    from flashtile.engine import block_manager
    if hash_kind == "hashlib":
        monkeypatch.setattr(block_manager, "xxhash", None)
    if hash_kind == "weak":
        monkeypatch.setattr(block_manager, "block_hash", _weak_hash)
    rng = random.Random(page_size)
    bm = BlockManager(num_blocks=14, page_size=page_size)
    pool, live, hits = {}, [], 0
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 10))] for _ in range(3)]

    def holds_its_own_kv(seq):
        return all(pool.get((seq.block_table[p // page_size], p % page_size))
                   == tuple(seq.token_ids[:p + 1]) for p in range(seq.num_computed_tokens))

    for _ in range(600):
        op = rng.random()
        if op < 0.25 or not live:
            seq = Sequence(rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(6))])
            free = bm.num_free_blocks
            if bm.allocate(seq):
                live.append(seq)
                hits += seq.num_cached_tokens > 0
                assert seq.num_computed_tokens == seq.num_cached_tokens < seq.num_tokens
            else:
                assert seq.block_table == [] and bm.num_free_blocks == free
        elif op < 0.9:
            seq = rng.choice(live)
            n = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
            table, free = list(seq.block_table), bm.num_free_blocks
            if not bm.ensure_slots(seq, n):
                assert seq.block_table == table and bm.num_free_blocks == free
                bm.free(seq)  # preempted: recomputed when admitted again
                live.remove(seq)
                continue
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[p // page_size]
                assert bm.blocks[block].ref_count == 1  # never write into a shared page
                pool[block, p % page_size] = tuple(seq.token_ids[:p + 1])
            seq.num_computed_tokens += n
            bm.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(3))
        if op >= 0.9 or (live and live[-1].num_tokens > 24):
            seq = live.pop(rng.randrange(len(live))) if op >= 0.9 else live.pop()
            bm.free(seq)
        bm.check_invariants()
        assert all(holds_its_own_kv(s) for s in live)
    assert hits > 10  # the schedule did exercise the prefix cache
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks  # no leak


def test_block_manager_hit_needs_the_same_place_in_the_chain(monkeypatch):
    """A page equal in tokens and hash but registered after another parent page (here a
    hash that ignores the chain) must not serve as a prompt's first page."""
    from flashtile.engine import block_manager
    monkeypatch.setattr(block_manager, "block_hash", _parentless_hash)
    bm = BlockManager(num_blocks=8, page_size=2)
    d = Sequence([5, 5, 7, 7, 1])
    bm.allocate(d)
    _run(bm, d, 5)
    bm.free(d)
    b = Sequence([7, 7, 2])
    assert bm.allocate(b) and b.num_cached_tokens == 0
    bm.check_invariants()


def test_block_manager_hit_needs_the_parent_page_unchanged(monkeypatch):
    """A cached page whose parent page was evicted and refilled with other tokens holds
    keys computed after the old parent: it must not follow the new one."""
    from flashtile.engine import block_manager
    monkeypatch.setattr(block_manager, "block_hash", _parentless_hash)
    bm = BlockManager(num_blocks=4, page_size=2)
    a = Sequence([1, 1, 2, 2, 3])
    bm.allocate(a)
    _run(bm, a, 5)
    p0, p1, _ = a.block_table
    bm.free(a)
    # LRU evicts a child before its parent; force the other order to build the case.
    bm._free.move_to_end(p0, last=False)
    x = Sequence([4, 4, 4])
    assert bm.allocate(x) and x.block_table[0] == p0
    _run(bm, x, 3)
    bm.free(x)
    q = Sequence([4, 4, 2, 2, 9])                        # p0 now holds (4, 4); p1 still (2, 2)
    assert bm.allocate(q) and q.block_table[0] == p0 and q.num_cached_tokens == 2
    assert p1 not in q.block_table and bm.blocks[p1].token_ids == (2, 2)
    bm.check_invariants()
