"""The engine's host-side core: SamplingParams, Sequence, BlockManager, Sampler.

All CPU and fast: these are Python and plain torch, no Triton.
"""

import dataclasses
import math

import pytest
import torch

from flashtile.engine.block_manager import BlockManager
from flashtile.engine.sampler import (Sampler, SamplingTensors,
                                      apply_frequency_presence_penalties, apply_min_p,
                                      apply_repetition_penalty, apply_top_k_top_p, step_seed)
from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.sequence import Sequence, SequenceStatus


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(n=0), ValueError, "n: expected an int >= 1"),
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
    (dict(presence_penalty=2.5), ValueError, "presence_penalty: expected a number in [-2, 2]"),
    (dict(frequency_penalty=math.nan), ValueError, "frequency_penalty: expected a finite"),
    (dict(frequency_penalty="1"), TypeError, "frequency_penalty: expected a float"),
    (dict(logit_bias=[1, 2]), TypeError, "logit_bias: expected a dict"),
    (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias: expected token ids >= 0"),
    (dict(logit_bias={"3": 1.0}), TypeError, "logit_bias: expected an int"),
    (dict(logit_bias={3: 101}), ValueError, "logit_bias[3]: expected a bias in [-100, 100]"),
    (dict(seed=True), TypeError, "seed: expected an int or None"),
    (dict(seed="1"), TypeError, "seed"),
    (dict(stop=[""]), ValueError, "stop[0]"),
    (dict(stop=["a", 3]), TypeError, "stop[1]"),
    (dict(stop=5), TypeError, "stop: expected a str, a list of str or None"),
    (dict(bad_words={"a": 1}), TypeError, "bad_words: expected a str"),
    (dict(stop_token_ids=[1, -1]), ValueError, "stop_token_ids[1]"),
    (dict(stop_token_ids="2"), TypeError, "stop_token_ids"),
    (dict(max_tokens=0), ValueError, "max_tokens: expected an int >= 1"),
    (dict(max_tokens=1.0), TypeError, "max_tokens"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(logprobs=21), ValueError, "logprobs: expected None or an int in [0, 20]"),
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

    preempted = []
    for _ in range(600):
        op = rng.random()
        if op < 0.25 or not live:
            if preempted and rng.random() < 0.5:
                seq = preempted.pop()  # recompute, prompt and output, hitting its own pages
            else:
                tail = [rng.randrange(3) for _ in range(rng.randrange(6))]
                seq = Sequence(rng.choice(prefixes) + tail)
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
            if bm.ensure_slots(seq, n):
                for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                    block = seq.block_table[p // page_size]
                    assert bm.blocks[block].ref_count == 1  # never write into a shared page
                    pool[block, p % page_size] = tuple(seq.token_ids[:p + 1])
                seq.num_computed_tokens += n
                bm.commit(seq)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(rng.randrange(3))
            else:
                assert seq.block_table == table and bm.num_free_blocks == free
                preempted.append(seq)
            if seq in preempted or seq.num_tokens > 24:  # > 24: finished, to fit the pool
                bm.free(seq)
                live.remove(seq)
        else:
            bm.free(live.pop(rng.randrange(len(live))))  # finished or aborted
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


# ---------------------------------------------------------------- Sampler

def _hf_processed(logits, seq):
    """Hugging Face's logits processors for one row (the reference), in generate's order:
    repetition penalty over prompt + output, temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper)
    p, ids = seq.sampling_params, torch.tensor([seq.token_ids])
    x = logits[None].clone()
    steps = [RepetitionPenaltyLogitsProcessor(p.repetition_penalty)]
    if not p.greedy:
        steps.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            steps.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            steps.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0:
            steps.append(MinPLogitsWarper(p.min_p))
    for step in steps:
        x = step(ids, x)
    return x[0]


def _seq(params, n_prompt=5, vocab=32, seed=0, n_out=0):
    g = torch.Generator().manual_seed(seed)
    seq = Sequence(torch.randint(vocab, (n_prompt,), generator=g).tolist(), params)
    for t in torch.randint(vocab, (n_out,), generator=g).tolist():
        seq.append_token(t)
    return seq


_MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
          SamplingParams(top_k=5), SamplingParams(top_p=0.6, temperature=1.3),
          SamplingParams(min_p=0.2), SamplingParams(top_k=8, top_p=0.8, min_p=0.05),
          SamplingParams(repetition_penalty=1.7, top_k=4),
          SamplingParams(temperature=0, repetition_penalty=0.6)]


def test_sampling_tensors_from_seqs():
    seqs = [_seq(SamplingParams(temperature=0, top_k=3, seed=4)),
            _seq(SamplingParams(top_k=50, seed=9, repetition_penalty=1.2), n_prompt=2, n_out=3),
            _seq(SamplingParams(top_k=0, top_p=0.5))]
    t = SamplingTensors.from_seqs(seqs, "cpu", vocab_size=32)
    assert t.temperatures.tolist() == [0.0, 1.0, 1.0]      # row 0 is greedy
    assert t.top_ks.tolist() == [32, 32, 32]                # off, or wider than the vocab
    assert t.top_ps.tolist() == [1.0, 1.0, 0.5] and not t.do_top_k and t.do_top_p
    assert t.any_greedy and not t.all_greedy and not t.do_min_p
    assert t.seeded_rows == [(1, step_seed(9, 3))]          # greedy rows draw nothing
    ids = seqs[1].token_ids
    assert t.token_ids.tolist() == [[seqs[0].token_ids[0]] * 5, ids, [seqs[2].token_ids[0]] * 5]
    assert SamplingTensors.from_seqs(seqs[:1], "cpu", 32).token_ids is None
    # Greedy rows without penalties: one set of tensors per batch size, built once.
    greedy = [_seq(SamplingParams(temperature=0, seed=i)) for i in range(3)]
    t = SamplingTensors.from_seqs(greedy, "cpu", 32)
    assert t.all_greedy and t.token_ids is None and t.seeded_rows == []
    assert t.temperatures.tolist() == [0.0] * 3 and t.top_ks.tolist() == [32] * 3
    assert SamplingTensors.from_seqs(greedy[::-1], "cpu", 32) is t
    assert len({step_seed(s, k) for s in range(30) for k in range(30)}) == 900


def test_sampler_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(len(_MIXED), 32, generator=torch.Generator().manual_seed(1)) * 3
    # One row asking for logprobs makes the sampler compute them for every row.
    params = [dataclasses.replace(_MIXED[0], logprobs=0)] + _MIXED[1:]
    seqs = [_seq(p, seed=i) for i, p in enumerate(params)]
    tokens, logprobs = Sampler(seed=0)(logits, SamplingTensors.from_seqs(seqs, "cpu", 32))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    mixed_tokens = tokens.tolist()
    for row, seq in enumerate(seqs):
        if seq.sampling_params.greedy:
            assert tokens[row] == _hf_processed(logits[row], seq).argmax()
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])
    # Nobody asks for logprobs: none are computed (the argmax of the raw logits, no fp32
    # copy, no logsumexp), and the tokens are the same, in 16-bit logits too.
    greedy = [_seq(SamplingParams(temperature=0), seed=i) for i in range(3)]
    tokens, none = Sampler()(logits[:3], SamplingTensors.from_seqs(greedy, "cpu", 32))
    assert tokens.tolist() == logits[:3].argmax(-1).tolist() and none is None
    half = logits[:3].to(torch.bfloat16)
    assert Sampler()(half, SamplingTensors.from_seqs(greedy, "cpu", 32))[0].tolist() \
        == half.float().argmax(-1).tolist()
    sampled, none = Sampler(seed=0)(logits, SamplingTensors.from_seqs(
        [_seq(p, seed=i) for i, p in enumerate(_MIXED)], "cpu", 32))
    assert none is None and sampled.tolist() == mixed_tokens
    with pytest.raises(ValueError, match="logits: expected shape"):
        Sampler()(logits, SamplingTensors.from_seqs(greedy, "cpu", 32))


def test_processors_match_hugging_face():
    """The batched penalty/temperature/top-k/top-p/min-p pipeline equals HF's processors
    applied row by row: the same tokens masked, the same values elsewhere."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(_MIXED), 32, generator=g) * 2
    seqs = [_seq(p, n_prompt=6, seed=i, n_out=3) for i, p in enumerate(_MIXED)]
    t = SamplingTensors.from_seqs(seqs, "cpu", 32)
    x = apply_repetition_penalty(logits, t.token_ids, t.repetition_penalties)
    x = x / torch.where(t.temperatures == 0, 1.0, t.temperatures)[:, None]
    x = apply_min_p(apply_top_k_top_p(x, t.top_ks, t.top_ps), t.min_ps)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(x[row], _hf_processed(logits[row], seq))


def test_penalties_and_bias_follow_the_openai_rule():
    """Rows mixing logit_bias, repetition, frequency and presence penalties (and none),
    outputs with repeated tokens: the sampler's processing equals the rule written out
    per row (bias, then Hugging Face's repetition penalty, then minus frequency x count
    and presence x seen over the output only); greedy takes its argmax."""
    g = torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=0, frequency_penalty=0.7),
              SamplingParams(temperature=0, presence_penalty=-1.5, logit_bias={3: 2.5}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=2, presence_penalty=1,
                             repetition_penalty=1.3, logit_bias={0: -100, 31: 7})]
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(torch.randint(32, (4,), generator=g).tolist(), p)
        for t in [5, 9, 5, 5, 2 * i, 9]:  # repeats: counts of 3, 2 and 1
            seq.append_token(t)
        seqs.append(seq)
    logits = torch.randn(len(seqs), 32, generator=g) * 2
    t = SamplingTensors.from_seqs(seqs, "cpu", 32)
    assert t.adjusts_logits and t.reads_token_ids
    tokens, _ = Sampler()(logits, t)
    for row, seq in enumerate(seqs):
        p, want = seq.sampling_params, logits[row].clone()
        for token, bias in (p.logit_bias or {}).items():
            want[token] += bias
        for token in set(seq.token_ids):
            if p.repetition_penalty != 1:
                want[token] = want[token] / p.repetition_penalty if want[token] > 0 \
                    else want[token] * p.repetition_penalty
        out = seq.completion_token_ids
        for token in set(out):
            want[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
        assert tokens[row] == want.argmax(), row
        x = logits.scatter_add(1, t.bias_ids, t.bias_values)
        x = apply_repetition_penalty(x, t.token_ids, t.repetition_penalties)
        x = apply_frequency_presence_penalties(x, t.output_ids, t.output_weights,
                                               t.frequency_penalties, t.presence_penalties)
        torch.testing.assert_close(x[row], want)
    plain = SamplingTensors.from_seqs(seqs[2:3], "cpu", 32)
    assert not plain.adjusts_logits and plain.output_ids is None and plain.bias_ids is None


@pytest.mark.parametrize("params", _MIXED[1:7], ids=lambda p: (
    f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}-rep{p.repetition_penalty}"))
@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
def test_sampler_draws_from_the_processed_distribution(params, seeded):
    """Many draws of one row: masked tokens never come, and the frequencies match HF's
    processed distribution (fixed seeds, so the bound is checked, not gambled on)."""
    n = 4000 if seeded else 20000  # seeded rows cost a host iteration each
    logits = torch.randn(32, generator=torch.Generator().manual_seed(3)) * 2
    base = _seq(params, seed=5, n_out=2)
    seqs = []
    for i in range(n):
        p = SamplingParams(**{**vars(params), "seed": i if seeded else None})
        seq = Sequence(base.prompt_token_ids, p)
        seq.token_ids += base.completion_token_ids
        seqs.append(seq)
    t = SamplingTensors.from_seqs(seqs, "cpu", 32)
    tokens, _ = Sampler(seed=11)(logits.expand(n, 32).contiguous(), t)
    probs = _hf_processed(logits, base).softmax(-1)
    freq = torch.bincount(tokens, minlength=32).double() / n
    assert (freq[probs == 0] == 0).all()
    bound = 4 * (probs * (1 - probs) / n).sqrt() + 1e-3
    assert ((freq - probs).abs() <= bound).all(), (freq, probs)


def test_sampler_seed_reproducible_in_any_batch():
    """A seeded request draws the same tokens alone and amid other rows, at any row;
    rows without a seed follow the Sampler's seed."""
    g = torch.Generator().manual_seed(4)
    p = SamplingParams(temperature=1.5, top_p=0.9, seed=1234)

    def run(extra_front, extra_back, steps=6):
        seq, others = _seq(p, seed=7), [_seq(q, seed=20 + i) for i, q in enumerate(_MIXED)]
        batch = others[:extra_front] + [seq] + others[len(others) - extra_back:]
        for _ in range(steps):
            logits = torch.randn(len(batch), 32, generator=g)
            logits[extra_front] = torch.arange(32) / 8  # the seeded row's logits: fixed
            tokens, _ = Sampler()(logits, SamplingTensors.from_seqs(batch, "cpu", 32))
            for s, tok in zip(batch, tokens.tolist()):
                s.append_token(tok)
        return seq.completion_token_ids

    alone = run(0, 0)
    assert run(3, 2) == alone and run(len(_MIXED), 0) == alone
    assert len(set(alone)) > 1                      # steps draw afresh
    other = SamplingParams(**{**vars(p), "seed": 1235})
    logits = (torch.arange(32) / 8).expand(8, 32)
    seqs = [_seq(q, seed=7) for q in [p, other] * 4]
    tokens, _ = Sampler()(logits, SamplingTensors.from_seqs(seqs, "cpu", 32))
    assert tokens[0::2].unique().numel() == 1 and tokens[1::2].unique().numel() == 1
    unseeded = [_seq(SamplingParams(), seed=i) for i in range(64)]
    t = SamplingTensors.from_seqs(unseeded, "cpu", 32)
    logits = torch.randn(64, 32, generator=g)
    a, b, c = (Sampler(seed=s)(logits, t)[0] for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampler_tiny_top_p_keeps_the_top_token():
    """1 - 1e-9 rounds to 1 in float32, so every cumulative probability is <= 1 - top_p:
    the top token must survive anyway (else the row is all -inf and softmax gives nan)."""
    logits = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    seqs = [_seq(SamplingParams(top_p=1e-9, seed=i), seed=i) for i in range(16)]
    tokens, _ = Sampler()(logits, SamplingTensors.from_seqs(seqs, "cpu", 32))
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.gpu
def test_sampler_on_cuda_never_syncs():
    """Building the step's tensors and sampling queue work only: CUDA's sync debug mode
    raises on any host synchronisation. Greedy rows still match HF, a seeded row still
    draws the same token at another place in another batch."""
    dev = torch.device("cuda")
    seeded = SamplingParams(top_k=6, temperature=1.2, seed=3, logprobs=0)  # logprobs too
    seqs = [_seq(p, seed=i, n_out=2) for i, p in enumerate(_MIXED)] + [_seq(seeded, seed=9)]
    logits = torch.randn(len(seqs), 32, generator=torch.Generator().manual_seed(8))
    logits_dev = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs = Sampler(seed=0)(logits_dev, SamplingTensors.from_seqs(seqs, dev, 32))
        again, _ = Sampler()(logits_dev.flip(0), SamplingTensors.from_seqs(seqs[::-1], dev, 32))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens, again = tokens.cpu(), again.cpu()
    assert again[0] == tokens[-1]
    for row, seq in enumerate(seqs):
        if seq.sampling_params.greedy:
            assert tokens[row] == _hf_processed(logits[row], seq).argmax()
    torch.testing.assert_close(logprobs.cpu(),
                               logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])
