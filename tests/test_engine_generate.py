"""LLM.generate end to end on CPU (fp32, flashtile's torch path): tokens equal
transformers' greedy generate; batch invariance under continuous batching, chunked
prefill and preemption; page sizes and backends agree; prefix-cache hits; no leaked
pages; stop conditions; bad input. CUDA-graph cases are marked gpu."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import shutil

import pytest
import torch

from flashtile.engine import LLM, SamplingParams
from flashtile.engine.sampling_params import RequestOutputKind
from flashtile.engine.block_manager import BlockManager
from flashtile.engine.runner import ModelRunner
from flashtile.engine.scheduler import Scheduler
from flashtile.engine.sequence import Sequence
from tests.engine_utils import VOCAB, engine_cpu, hf_greedy, make_checkpoint, make_tokenizer

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# One page of the llama case: 2 (k, v) x 2 layers x 2 kv heads x head_dim 16 x fp32.
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_checkpoint(path, "llama")
    make_tokenizer(path)
    return path, model


_DEFAULTS = dict(dtype="float32", device="cpu", max_model_len=64, page_size=16)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def async_scheduling(request, monkeypatch):
    """Every test in both scheduling modes: asynchronous scheduling has nothing to
    overlap on CPU, but its bookkeeping (placeholders, discarded tokens, lagging
    outputs) is the same as on CUDA."""
    monkeypatch.setitem(_DEFAULTS, "async_scheduling", request.param)
    return request.param


def _llm(path, **kw):
    return LLM(str(path), **{**_DEFAULTS, **kw})


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _assert_pool_empty(llm):
    bm = llm.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()


def test_greedy_equals_transformers(checkpoint):
    path, model = checkpoint
    prompts = _prompts([1, 6, 19, 33])
    llm = _llm(path)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(model, p, 12) for p in prompts]
    for o, p in zip(outs, prompts):
        assert o.prompt_token_ids == p and o.finished
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time
    _assert_pool_empty(llm)


class _OpenAIPenalties:
    """The reference for logit_bias and the frequency and presence penalties: OpenAI's
    formula, as a transformers logits processor over one prompt's continuation (its
    output tokens only: the prompt does not count)."""

    def __init__(self, n_prompt, params):
        self.n_prompt, self.p = n_prompt, params

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, bias in (self.p.logit_bias or {}).items():
            scores[:, token] += bias
        out = input_ids[0, self.n_prompt:].tolist()
        for token in set(out):
            scores[:, token] -= self.p.frequency_penalty * out.count(token) \
                + self.p.presence_penalty
        return scores


def test_penalties_and_logit_bias_equal_transformers_with_openai_rule(checkpoint):
    """Greedy requests with frequency/presence penalties and a logit bias, batched with a
    plain one: each equals transformers' greedy generate with the OpenAI rule as a logits
    processor, and the penalised ones differ from plain greedy (the feature acts)."""
    from transformers import LogitsProcessorList

    path, model = checkpoint
    prompts = _prompts([3, 8, 5])
    base = dict(temperature=0, max_tokens=12)
    params = [SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, **base),
              SamplingParams(presence_penalty=2.0, logit_bias={11: 4.0, 12: -100}, **base),
              SamplingParams(**base)]
    outs = _tokens(_llm(path).generate(prompts, params, use_tqdm=False))
    for prompt, p, got in zip(prompts, params, outs):
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=12, pad_token_id=0,
                              logits_processor=LogitsProcessorList(
                                  [_OpenAIPenalties(len(prompt), p)]))
        assert got == want[0, len(prompt):].tolist()
        if p.adjusts_logits:
            assert got != hf_greedy(model, prompt, 12) and 12 not in got
    forced = _llm(path).generate(prompts[:1], SamplingParams(
        logit_bias={7: 100}, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert _tokens(forced) == [[7] * 5]  # +100 outweighs every other logit here


def test_n_completions_per_prompt(checkpoint):
    """SamplingParams(n=k) in generate: k completions per prompt in one RequestOutput,
    indexed 0..k-1, in prompt order beside n=1 prompts; greedy ones all equal
    transformers' greedy; seeded ones equal single requests seeded seed + i (and differ);
    add_request takes one completion only; every page returns to the pool."""
    path, model = checkpoint
    prompts = _prompts([4, 9, 6], seed=3)
    llm = _llm(path)
    sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8, n=2),
                                  SamplingParams(temperature=0, max_tokens=8), sampled],
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1, 3]
    assert [c.index for o in outs for c in o.outputs] == [0, 1, 0, 0, 1, 2]
    assert [o.prompt_token_ids for o in outs] == prompts
    for o, p in zip(outs[:2], prompts):
        assert all(c.token_ids == hf_greedy(model, p, 8) for c in o.outputs)
    singles = llm.generate([prompts[2]] * 3, [dataclasses.replace(sampled, n=1, seed=5 + i)
                                              for i in range(3)], use_tqdm=False)
    got = [c.token_ids for c in outs[2].outputs]
    assert got == [s.outputs[0].token_ids for s in singles] and len(set(map(tuple, got))) > 1
    m = outs[2].metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    with pytest.raises(ValueError, match="n: expected 1 for one request"):
        llm.add_request(prompts[0], sampled)
    with pytest.raises(ValueError, match="n: expected an int >= 1"):
        SamplingParams(n=0)
    _assert_pool_empty(llm)


def test_top_logprobs_are_the_models(checkpoint):
    """SamplingParams.logprobs = k: at each generated position the k most likely tokens
    and their logprobs under transformers' distribution (most likely first; greedy's
    chosen token is the first), k per request in one batch; logprobs=0 and None give
    no alternatives; DELTA outputs carry each step's alternatives."""
    path, model = checkpoint
    prompts = _prompts([5, 11, 7], seed=4)
    base = dict(max_tokens=6, ignore_eos=True)
    params = [SamplingParams(temperature=0, logprobs=3, **base),
              SamplingParams(temperature=1.0, seed=2, logprobs=5, **base),
              SamplingParams(temperature=0, logprobs=0, **base)]
    llm = _llm(path)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        ids = torch.tensor([out.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            lp = model(ids).logits[0].double().log_softmax(-1)
        want = lp[len(out.prompt_token_ids) - 1:-1]  # the distribution of each output
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64),
                                   want.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        assert c.cumulative_logprob == pytest.approx(sum(c.logprobs), abs=1e-9)
        if not p.logprobs:
            assert c.top_logprobs is None
            continue
        assert len(c.top_logprobs) == len(c.token_ids)
        for row, alt, token in zip(want, c.top_logprobs, c.token_ids):
            values, top_ids = row.topk(p.logprobs)
            assert list(alt) == top_ids.tolist()
            torch.testing.assert_close(torch.tensor(list(alt.values()), dtype=torch.float64),
                                       values, atol=1e-4, rtol=0)
            if p.greedy:
                assert next(iter(alt)) == token
    delta = dataclasses.replace(params[0], output_kind=RequestOutputKind.DELTA)
    llm.add_request(prompts[0], delta)
    steps = []
    while llm.has_unfinished_requests():
        steps += [o.outputs[0] for o in llm.step()]
    assert steps[-1].cumulative_logprob == pytest.approx(outs[0].outputs[0].cumulative_logprob,
                                                        abs=1e-4)
    assert llm.get_tokenizer() is llm.tokenizer
    got, whole = [a for s in steps for a in s.top_logprobs], outs[0].outputs[0].top_logprobs
    assert [list(a) for a in got] == [list(a) for a in whole]  # alone: fp32 rounding apart
    torch.testing.assert_close([list(a.values()) for a in got],
                               [list(a.values()) for a in whole], atol=1e-5, rtol=0)
    _assert_pool_empty(llm)


def _check_prompt_logprobs(model, out, k, atol=1e-4):
    """out.prompt_logprobs against transformers' log_softmax: None at position 0, then
    the prompt token's logprob first and the k most likely tokens' after it."""
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    for pos in range(1, len(ids)):
        entry, row = out.prompt_logprobs[pos], lp[pos - 1]
        token = ids[pos]
        assert next(iter(entry)) == token
        torch.testing.assert_close(entry[token], row[token].item(), atol=atol, rtol=0)
        values, top = row.topk(k) if k else (row[:0], torch.tensor([], dtype=torch.long))
        assert set(entry) == {token, *top.tolist()}
        for t, v in zip(top.tolist(), values.tolist()):
            torch.testing.assert_close(entry[t], v, atol=atol, rtol=0)


def test_prompt_logprobs_are_the_models(checkpoint):
    """SamplingParams.prompt_logprobs = k: each prompt token's logprob given the tokens
    before it and the k most likely tokens there (transformers' distribution), through
    chunked prefill (16 tokens a step), beside requests without them, a prompt whose
    prefix is cached (computed anyway), preemption (recomputed), a one-token prompt, and
    the first DELTA output only; the completions equal those without prompt logprobs."""
    path, model = checkpoint
    prompts = _prompts([23, 40, 1, 9], seed=5)
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    ks = [3, 0, 2, None]
    params = [SamplingParams(prompt_logprobs=k, logprobs=1 if k == 3 else None, **base)
              for k in ks]
    plain = _tokens(_llm(path).generate(prompts, SamplingParams(**base), use_tqdm=False))
    llm = _llm(path, max_num_batched_tokens=16, kv_cache_memory=6 * 16 * BYTES_PER_TOKEN)
    llm.generate([prompts[1]], SamplingParams(**base), use_tqdm=False)  # cache its pages
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == plain
    for out, k in zip(outs, ks):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check_prompt_logprobs(model, out, k)
    _assert_pool_empty(llm)
    # Preemption: two sequences that grow past the six-page pool together.
    long = _prompts([30, 31], seed=6)
    grow = SamplingParams(prompt_logprobs=1, **{**base, "max_tokens": 30})
    outs = llm.generate(long, grow, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for out in outs:
        _check_prompt_logprobs(model, out, 1)
    _assert_pool_empty(llm)
    delta = SamplingParams(prompt_logprobs=0, output_kind=RequestOutputKind.DELTA, **base)
    llm.add_request(prompts[0], delta)
    steps = []
    while llm.has_unfinished_requests():
        steps += llm.step()
    assert [o.prompt_logprobs is not None for o in steps] == [True] + [False] * (
        len(steps) - 1)
    _check_prompt_logprobs(model, steps[0], 0)
    with pytest.raises(ValueError, match=r"prompt_logprobs: expected None or an int in "
                       r"\[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)


def test_batch_invariance_with_chunks_staggering_and_preemption(checkpoint):
    path, _ = checkpoint
    prompts = _prompts([3, 41, 9, 30, 17], seed=1)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [_tokens(_llm(path).generate([p], params, use_tqdm=False))[0] for p in prompts]
    # Budget 16 tokens a step: the long prompts are prefilled in chunks beside decodes.
    # Six pages of 16 tokens: one 64-token sequence fits, all five do not.
    llm = _llm(path, max_num_batched_tokens=16, kv_cache_memory=6 * 16 * BYTES_PER_TOKEN)
    assert llm.runner.num_blocks == 6
    chunked = []
    schedule = llm.scheduler.schedule

    def spy():
        scheduled = schedule()
        chunked.extend(n for s, n in scheduled if n > 1 and s.num_computed_tokens > 0)
        return scheduled

    llm.scheduler.schedule = spy
    ids, done = {}, {}
    arrivals = {0: [0, 1], 3: [2, 3], 5: [4]}  # step -> prompts arriving before it
    step = 0
    while len(done) < len(prompts):
        for i in arrivals.get(step, []):
            ids[llm.add_request(prompts[i], params)] = i
        for out in llm.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
    assert [done[i] for i in range(len(prompts))] == alone
    assert llm.scheduler.num_preemptions > 0 and chunked
    _assert_pool_empty(llm)


@pytest.mark.parametrize("seed", range(3))
def test_random_schedules_equal_alone(checkpoint, seed):
    """Random workloads stepped by hand: prompts sharing a prefix (prefix-cache hits),
    greedy and seeded sampling, staggered arrivals, aborts, chunks and a pool too small
    for all (preemption). Each finished request equals its run alone; the pool ends
    empty."""
    path, _ = checkpoint
    rng = random.Random(seed)
    shared = _prompts([rng.choice([16, 20, 33])], seed=10 + seed)[0]
    requests = []  # (prompt, params, arrival step, aborted two steps after it)
    for i, tail in enumerate(_prompts([rng.randint(1, 20) for _ in range(8)], seed=seed)):
        prompt = (shared + tail)[:50] if i % 3 else tail
        max_tokens = rng.randint(1, 64 - len(prompt))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) \
            if i % 2 else SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(99),
                                         max_tokens=max_tokens, ignore_eos=True)
        requests.append((prompt, params, rng.randint(0, 6), i in (3, 6)))
    alone = _llm(path, enable_prefix_caching=False)
    want = [_tokens(alone.generate([p], sp, use_tqdm=False))[0] for p, sp, _, _ in requests]
    llm = _llm(path, max_num_batched_tokens=24, kv_cache_memory=5 * 16 * BYTES_PER_TOKEN)
    ids, rids, done, aborted, hits, step = {}, {}, {}, set(), 0, 0
    while len(done) + len(aborted) < len(requests):
        for i, (prompt, params, arrival, abort) in enumerate(requests):
            if step == arrival:
                rids[i] = llm.add_request(prompt, params)
                ids[rids[i]] = i
            elif abort and step == arrival + 2 and i not in done:
                llm.abort_request(rids[i])
                aborted.add(i)
        for out in llm.step():
            if out.finished and ids[out.request_id] not in aborted:
                done[ids[out.request_id]] = out.outputs[0].token_ids
                hits += out.num_cached_tokens > 0
        step += 1
        assert step < 1000
    assert {i: want[i] for i in done} == done and len(done) >= 6
    preemptions = llm.scheduler.num_preemptions
    assert preemptions > 0 and hits > 0, (preemptions, hits)
    _assert_pool_empty(llm)


@pytest.mark.parametrize("kw", [dict(page_size=64), dict(page_size=256, max_model_len=256),
                                dict(attention_backend="sdpa"),
                                dict(attention_backend="naive")],
                         ids=["page64", "page256", "sdpa", "naive"])
def test_page_sizes_and_backends_agree(checkpoint, kw):
    path, _ = checkpoint
    prompts = _prompts([2, 23, 40], seed=2)
    want = _tokens(_llm(path).generate(prompts, GREEDY, use_tqdm=False))  # flashtile, 16
    llm = _llm(path, **kw)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    _assert_pool_empty(llm)


def test_prefix_cache_hit_equals_miss(checkpoint, monkeypatch):
    path, _ = checkpoint
    shared = _prompts([37], seed=3)[0]
    prompts = [shared + [5, 6], shared + [7]]  # two full pages in common
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    cached, reported = [], []
    allocate = BlockManager.allocate

    def spy(self, seq):
        ok = allocate(self, seq)
        cached.append(seq.num_cached_tokens)
        return ok

    monkeypatch.setattr(BlockManager, "allocate", spy)
    runs = {}
    for caching in (True, False):
        llm = _llm(path, enable_prefix_caching=caching)
        # One at a time, so the second prompt can hit the pages the first one wrote.
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        runs[caching] = [o.outputs[0] for o in outs]
        reported += [o.num_cached_tokens for o in outs]  # RequestOutput's, as vLLM's
        _assert_pool_empty(llm)
    assert cached == [0, 32, 0, 0] == reported
    for hit, miss in zip(runs[True], runs[False]):
        assert hit.token_ids == miss.token_ids
        torch.testing.assert_close(hit.logprobs, miss.logprobs, atol=1e-5, rtol=0)


# kv_cache_dtype="fp8" serves 16-bit models: the FP8 tests run the checkpoint in fp16.
FP8_KV = dict(dtype="float16", kv_cache_dtype="fp8")


def _fp8_rounded(x, dtype, scale=None):
    """attention.to_pool for a 16-bit pool standing in for an FP8 one: x / scale rounded
    through e4m3 as the FP8 pool stores it, times scale, back in x's dtype."""
    scale = 1.0 if scale is None else scale
    return ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            * scale).to(x.dtype)


@pytest.mark.parametrize("calculate", [False, True], ids=["scale1", "calculated"])
def test_fp8_kv_cache_reads_as_the_values_it_holds(checkpoint, monkeypatch, calculate):
    """kv_cache_dtype="fp8": tokens and logprobs equal those of an fp16 pool holding the
    same FP8-rounded keys and values (every prefill over the pool there too), through
    fresh prompts, prefill chunks beside decodes, and decode steps; with scales of 1.0,
    or set from the first step (calculate_kv_scales: the largest |k| maps to 200, |v| to
    100). The FP8 pool holds twice the pages of the fp16 one in the same bytes."""
    import flashtile.engine.attention as attention

    path, _ = checkpoint
    prompts = _prompts([3, 41, 9, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    memory = 12 * 16 * BYTES_PER_TOKEN // 2  # twelve fp16 pages
    fp8 = _llm(path, max_num_batched_tokens=16, kv_cache_memory=memory,
               calculate_kv_scales=calculate, **FP8_KV)
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.runner.num_blocks == 24
    got = [o.outputs[0] for o in fp8.generate(prompts, params, use_tqdm=False)]
    _assert_pool_empty(fp8)
    layers = fp8.runner.model.attention_layers()
    scales = [float(x) for a in layers for x in (a.k_scale, a.v_scale)]
    if calculate:  # the first step's keys (values) reach 200 (100) in the pool, none more
        assert all(0 < s != 1.0 for s in scales) and not any(a.calibrate for a in layers)
        pools = fp8.runner.kv_cache.float().abs().flatten(2).amax(-1)  # (2, layers)
        assert (pools[0] <= 448).all() and (pools[0] >= 200).all()
    else:
        assert scales == [1.0] * len(scales)
    monkeypatch.setattr(attention, "to_pool", _fp8_rounded)
    ref = _llm(path, max_num_batched_tokens=16, kv_cache_memory=memory, dtype="float16")
    assert ref.runner.num_blocks == 12
    for attn in ref.runner.model.attention_layers():
        attn.quantized, attn.calibrate = True, calculate
        attn.k_scale, attn.v_scale = torch.ones(()), torch.ones(())
    want = [o.outputs[0] for o in ref.generate(prompts, params, use_tqdm=False)]

    def gap(xs, ys):  # the largest logprob difference of two runs
        return max(abs(x - y) for a, b in zip(xs, ys) for x, y in zip(a.logprobs, b.logprobs))

    assert [a.token_ids for a in got] == [b.token_ids for b in want]
    # fp16 runs: the two paths round their fp32 attention differently (measured 0.004;
    # fp16 against fp32 pools 0.002), and the stand-in pool rounds scale * entry to fp16
    # (0.011 with calculated scales; 0.004 with them rounded to powers of two).
    assert gap(got, want) < 2e-2
    # The rounding is there: an unrounded fp16 pool is far further away (measured 0.8).
    monkeypatch.undo()
    plain = _llm(path, max_num_batched_tokens=16, dtype="float16")
    other = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert gap(got, other) > 10 * gap(got, want)


def test_fp8_kv_cache_batch_invariance_and_prefix_hits(checkpoint, monkeypatch):
    """Over an FP8 pool a request's greedy tokens do not depend on its batch, its
    prompt's chunks, preemption or prefix-cache hits: every step reads the same rounded
    keys."""
    path, _ = checkpoint
    shared = _prompts([33], seed=5)[0]
    prompts = [shared + [5], _prompts([30], seed=6)[0], shared + [7, 8], [9, 10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (20, 30, 14, 40)]
    alone = _llm(path, enable_prefix_caching=False, **FP8_KV)
    want = [_tokens(alone.generate([p], sp, use_tqdm=False))[0]
            for p, sp in zip(prompts, params)]
    # Six pages of 16 tokens: the sequences outgrow them (preemption); budget 16 tokens
    # a step (chunks); the third prompt arrives after the first has written its pages.
    llm = _llm(path, max_num_batched_tokens=16, kv_cache_memory=6 * 16 * BYTES_PER_TOKEN // 4,
               **FP8_KV)
    assert llm.runner.num_blocks == 6
    cached, allocate = [], BlockManager.allocate

    def spy(self, seq):
        ok = allocate(self, seq)
        cached.append(seq.num_cached_tokens)
        return ok

    monkeypatch.setattr(BlockManager, "allocate", spy)
    outs = _staggered(llm, prompts, params, {0: [0, 1], 4: [2, 3]})
    assert [o.token_ids for o in outs] == want
    assert llm.scheduler.num_preemptions > 0 and max(cached) >= 32, cached
    _assert_pool_empty(llm)


def test_kv_scales_from_the_checkpoint(checkpoint, tmp_path):
    """A checkpoint's KV-cache scales (vLLM's self_attn.k_scale / v_scale, or the older
    kv_scale for both): an FP8 pool takes them, calculate_kv_scales replaces them, a
    16-bit pool ignores them; a bad one is an error naming the tensor."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    scaled = tmp_path / "scaled"
    shutil.copytree(path, scaled)
    extra = {"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
             "model.layers.0.self_attn.v_scale": torch.tensor(0.5),
             "model.layers.1.self_attn.kv_scale": torch.tensor(2.0)}
    save_file({**tensors, **extra}, scaled / "model.safetensors")
    layers = _llm(scaled, **FP8_KV).runner.model.attention_layers()
    assert [(float(a.k_scale), float(a.v_scale)) for a in layers] == [(0.25, 0.5), (2.0, 2.0)]
    calculated = _llm(scaled, calculate_kv_scales=True, **FP8_KV)
    calculated.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert all(float(a.k_scale) not in (0.25, 2.0)
               for a in calculated.runner.model.attention_layers())
    plain = _llm(scaled)
    assert all(a.k_scale is None for a in plain.runner.model.attention_layers())
    assert _tokens(plain.generate([[5, 6, 7]], GREEDY, use_tqdm=False)) == \
        _tokens(_llm(path).generate([[5, 6, 7]], GREEDY, use_tqdm=False))
    save_file({**tensors, "model.layers.0.self_attn.k_scale": torch.tensor(-1.0)},
              scaled / "model.safetensors")
    with pytest.raises(ValueError, match="k_scale'.*a positive finite scale, got -1.0"):
        _llm(scaled, **FP8_KV)


def test_kv_cache_dtype_errors(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of .*'fp8_e5m2'.*"
                                         "got 'fp4'"):
        _llm(path, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected 'auto' with dtype "
                                         "torch.float32"):
        _llm(path, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected 'auto' with "
                                         "attention_backend 'sdpa'"):
        _llm(path, kv_cache_dtype="fp8_e5m2", attention_backend="sdpa", dtype="float16")
    with pytest.raises(ValueError, match="calculate_kv_scales: expected False with "
                                         "kv_cache_dtype 'auto'"):
        _llm(path, calculate_kv_scales=True)
    with pytest.raises(TypeError, match="calculate_kv_scales: expected a bool, got str"):
        _llm(path, calculate_kv_scales="yes", **FP8_KV)


STOP_PROMPT = "The capital of France is"


def _free_run(llm):
    """STOP_PROMPT's 24 greedy tokens without a stop: (output, text, ids, a stop string
    of two characters from the middle of the text)."""
    free = llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    return free, text, ids, text[len(text) // 2:len(text) // 2 + 2]


def test_stop_conditions(checkpoint, tmp_path):
    path, _ = checkpoint
    llm = _llm(path)
    prompt = STOP_PROMPT
    free, text, ids, stop = _free_run(llm)
    assert free.outputs[0].finish_reason == "length" and len(ids) == 24 and text
    assert free.prompt == prompt and free.prompt_token_ids == llm.tokenizer.encode(prompt)

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"
    assert out.stop_reason == stop and ids[:len(out.token_ids)] == out.token_ids

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              stop_token_ids=[ids[5]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:ids.index(ids[5]) + 1] and out.stop_reason == ids[5]

    # An end-of-sequence id from generation_config.json, and ignore_eos.
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[3]}))
    eos_llm = _llm(eos_dir)
    out = eos_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:ids.index(ids[3]) + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    out = eos_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids

    # max_model_len ends a request that max_tokens would let run on.
    n = len(free.prompt_token_ids)
    out = _llm(path, max_model_len=n + 5).generate(
        prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:5] and out.finish_reason == "length"
    # A prompt of exactly max_model_len tokens still gets the one token its logits give.
    out = _llm(path, max_model_len=n).generate(prompt, SamplingParams(temperature=0),
                                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:1] and out.finish_reason == "length"


def test_min_tokens_and_the_stop_string_kept(checkpoint, tmp_path):
    """min_tokens: the end-of-sequence and stop ids are never drawn before it and stop
    strings not looked for (transformers' min_new_tokens gives the same tokens);
    include_stop_str_in_output keeps the stop string; min_tokens > max_tokens is a
    ValueError naming it."""
    path, model = checkpoint
    llm = _llm(path)
    prompt = STOP_PROMPT
    free, text, ids, stop = _free_run(llm)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                              ignore_eos=True, include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop) + len(stop)] and out.stop_reason == stop
    # A stop string completed before min_tokens tokens does not end the completion.
    first = next(i for i in range(1, 25) if stop in llm.tokenizer.decode(ids[:i]))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                              ignore_eos=True, min_tokens=24),
                       use_tqdm=False)[0].outputs[0]
    assert first < 24 and out.token_ids == ids and out.finish_reason == "length"
    # The end-of-sequence id (generation_config.json) and a stop id, masked until 6 tokens.
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[3]}))
    eos_llm = _llm(eos_dir)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=6,
                            stop_token_ids=[ids[1]])
    got = eos_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [ids[3], ids[1]]
    try:
        want = model.generate(torch.tensor([free.prompt_token_ids]), do_sample=False,
                               max_new_tokens=24, min_new_tokens=6, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    want = want[0, len(free.prompt_token_ids):].tolist()
    assert got == want and got[:6] != ids[:6]
    assert not {ids[1], ids[3]} & set(got[:6])
    with pytest.raises(ValueError, match=r"min_tokens: expected an int in \[0, "
                       r"max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_allowed_token_ids(checkpoint):
    """allowed_token_ids: greedy takes the most likely allowed id under transformers'
    logits at each position, sampling draws only allowed ids, and a row without a list
    in the same batch is unchanged; an empty list or an id past the vocabulary is a
    ValueError naming the argument."""
    path, model = checkpoint
    llm = _llm(path)
    prompts = _prompts([7, 12, 9], seed=8)
    allowed = [4, 17, 33, 60, 99]
    base = dict(max_tokens=8, ignore_eos=True)
    plain = llm.generate(prompts[2], SamplingParams(temperature=0, **base),
                         use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(prompts, [
        SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=0, **base),
        SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed, **base),
        SamplingParams(temperature=0, **base)], use_tqdm=False)
    greedy = outs[0].outputs[0]
    ids = torch.tensor([outs[0].prompt_token_ids + greedy.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(outs[0].prompt_token_ids) - 1:-1]
    assert greedy.token_ids == [allowed[i] for i in logits[:, allowed].argmax(-1).tolist()]
    # logprobs stay the raw distribution's
    torch.testing.assert_close(greedy.logprobs, logits.double().log_softmax(-1).gather(
        1, torch.tensor(greedy.token_ids)[:, None])[:, 0].tolist(), atol=1e-4, rtol=0)
    assert set(outs[1].outputs[0].token_ids) <= set(allowed)
    assert outs[2].outputs[0].token_ids == plain
    with pytest.raises(ValueError, match=r"allowed_token_ids: expected a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match=rf"allowed_token_ids: expected token ids in \[0, "
                       rf"{VOCAB}\), got {VOCAB}"):
        llm.generate(prompts[0], SamplingParams(allowed_token_ids=[1, VOCAB]), use_tqdm=False)
    _assert_pool_empty(llm)


def test_bad_words(checkpoint):
    """bad_words (vLLM's rule): a one-token word never comes, and a word of two tokens
    never gets its second token right after its first. The logit bias pushes both
    words' first tokens, so the rule fires at every other step; the tokens equal
    transformers' greedy decoding with the same bias and the rule applied by hand."""
    path, model = checkpoint
    llm = _llm(path)
    tok = llm.tokenizer
    two, one = tok.encode("zz", add_special_tokens=False), \
        tok.encode("you", add_special_tokens=False)
    assert len(two) == 2 and two[0] == two[1] and len(one) == 1  # the tiny tokenizer's
    bias = {two[0]: 30.0, one[0]: 30.0}
    prompt = _prompts([9], seed=4)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                              logit_bias=bias, bad_words=["zz", "you"]),
                       use_tqdm=False)[0].outputs[0].token_ids
    ids = list(prompt)
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        for t, b in bias.items():
            logits[t] += b
        logits[one[0]] = float("-inf")
        if ids[-1] == two[0] and len(ids) > len(prompt):  # completion tokens only
            logits[two[1]] = float("-inf")
        ids.append(int(logits.argmax()))
    assert out == ids[len(prompt):]
    assert one[0] not in out and out.count(two[0]) >= 3  # the bias made the rule fire
    with pytest.raises(ValueError, match=r"bad_words\[1\]: expected a non-empty string"):
        SamplingParams(bad_words=["zz", ""])
    _assert_pool_empty(llm)


def test_bad_words_ids_take_the_spaced_form():
    """Tokenizer.bad_words_ids: a word and, unless it starts with a space, its spaced
    form where that has as many tokens and another first one (vLLM's rule); the
    sampler bars a word's last token only after the rest of it."""
    from flashtile.engine.sampler import bad_word_bans
    from flashtile.engine.tokenizer import Tokenizer

    vocab = {"ab": [5, 6], " ab": [7, 6], "c": [8], " c": [9, 8], " d": [3]}
    fake = Tokenizer.__new__(Tokenizer)
    fake.encode = lambda text, add_special_tokens=True: vocab[text]
    assert fake.bad_words_ids(["ab", "c", " d"]) == [(5, 6), (7, 6), (8,), (3,)]
    words = [(5, 6), (8,)]
    assert bad_word_bans([1, 5], words) == [6, 8]
    assert bad_word_bans([5, 1], words) == [8]
    assert bad_word_bans([], words) == [8]


def test_beam_search_equals_transformers(checkpoint):
    """LLM.beam_search (vLLM's): without an end-of-sequence token (ignore_eos; None for
    transformers) the beam_width best beams are transformers' num_beams beams, token for
    token and best first, their cumulative logprobs equal to its scores times the
    length; beam_width 1 is greedy; a beam width past MAX_LOGPROBS / 2 is refused."""
    from flashtile.engine import BeamSearchParams

    path, model = checkpoint
    llm = _llm(path)
    prompts = _prompts([6, 11], seed=12)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3,
                            num_return_sequences=3, do_sample=False, max_new_tokens=5,
                            eos_token_id=None, pad_token_id=0, length_penalty=0.0,
                            return_dict_in_generate=True, output_scores=True)
        assert [b.tokens for b in out.sequences] == hf.sequences.tolist()
        torch.testing.assert_close([b.cum_logprob for b in out.sequences],
                                   hf.sequences_scores.tolist(), atol=1e-4, rtol=0)
        assert all(b.finish_reason == "length" and b.text is not None for b in out.sequences)
        assert [len(b.logprobs) for b in out.sequences] == [5] * 3
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    ones = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=10,
                                                     ignore_eos=True))
    assert [o.sequences[0].tokens[len(p):] for o, p in zip(ones, prompts)] == \
        _tokens(greedy)
    # An end-of-sequence token ends a beam ("stop"); made here of the greedy first
    # token, so the best beam of step one finishes at once, ranked by its score without
    # that token in the length.
    first = _tokens(greedy)[0][0]
    llm.scheduler.eos_token_ids = frozenset({first})
    out = llm.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    stopped = [b for b in out.sequences if b.finish_reason == "stop"]
    assert [b.tokens for b in stopped] == [prompts[0] + [first]]
    assert all(b.tokens[-1] != first for b in out.sequences if b not in stopped)
    with pytest.raises(ValueError, match=r"beam_width: expected an int in \[1, 10\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    _assert_pool_empty(llm)


def test_truncate_prompt_tokens(checkpoint):
    """truncate_prompt_tokens=k (vLLM's left truncation): a request keeps its prompt's
    last k tokens, as if sent alone: the same completion, prompt_token_ids and (a text
    prompt) the kept tokens' text; shorter prompts are untouched, -1 keeps max_model_len
    tokens, and a prompt longer than max_model_len fits once truncated; 0 is a
    ValueError naming the argument."""
    path, _ = checkpoint
    llm = _llm(path)
    long, short = _prompts([40, 5], seed=9)
    base = dict(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([long[-12:], short], SamplingParams(**base), use_tqdm=False)
    outs = llm.generate([long, short], SamplingParams(truncate_prompt_tokens=12, **base),
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [long[-12:], short]
    assert _tokens(outs) == _tokens(want)
    text = llm.tokenizer.decode(long)
    out = llm.generate(text, SamplingParams(truncate_prompt_tokens=12, **base),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(text)[-12:]
    assert out.prompt == llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    limit = llm.config.max_model_len
    huge = (long * (limit // len(long) + 2))[:limit + 7]
    out = llm.generate(huge, SamplingParams(truncate_prompt_tokens=limit - 6, **base),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == huge[-(limit - 6):] and len(out.outputs[0].token_ids) == 6
    assert SamplingParams(truncate_prompt_tokens=-1).truncate(huge, limit) == huge[-limit:]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens: expected None, -1 "
                       r"\(max_model_len\) or an int >= 1, got 0"):
        SamplingParams(truncate_prompt_tokens=0)
    _assert_pool_empty(llm)


def test_streamed_text_is_never_taken_back(checkpoint):
    path, _ = checkpoint
    llm = _llm(path)
    prompt = "Hello world"
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[-4:-1]
    rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                 ignore_eos=True))
    seen = []
    while llm.has_unfinished_requests():
        seen += [o.outputs[0].text for o in llm.step() if o.request_id == rid]
    assert all(seen[-1].startswith(s) for s in seen)
    assert seen[-1] == text[:text.index(stop)]


@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop-string"])
def test_output_kinds_carry_the_same_completion(checkpoint, stop):
    """step() as SamplingParams.output_kind asks: DELTA outputs add up to the CUMULATIVE
    ones (text, token ids, logprobs; a held-back stop-string prefix comes later, never
    twice), FINAL_ONLY gives one output, the whole completion, at the end."""
    from flashtile.engine.sampling_params import RequestOutputKind as Kind
    path, _ = checkpoint
    llm = _llm(path)
    prompt = "Hello world"
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    kw = dict(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0,
              stop=text[-4:-1] if stop else None)
    ids = {llm.add_request(prompt, SamplingParams(**kw, output_kind=kind)): kind
           for kind in Kind}
    outs = {kind: [] for kind in Kind}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outs[ids[out.request_id]].append(out)
    whole = outs[Kind.CUMULATIVE][-1].outputs[0]
    assert whole.finish_reason == ("stop" if stop else "length")
    (final,) = outs[Kind.FINAL_ONLY]
    deltas = outs[Kind.DELTA]
    assert final.finished and final.outputs[0] == whole
    assert len(deltas) == len(outs[Kind.CUMULATIVE]) == len(whole.token_ids)
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == whole.token_ids
    assert sum((d.outputs[0].logprobs for d in deltas), []) == whole.logprobs
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].outputs[0].finish_reason == whole.finish_reason
    assert deltas[0].prompt_token_ids == final.prompt_token_ids == llm.tokenizer.encode(
        prompt)
    with pytest.raises(TypeError, match="output_kind: expected a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_generate_input_forms_and_chat(checkpoint):
    from transformers import AutoTokenizer
    path, _ = checkpoint
    llm = _llm(path)
    texts = ["Hello world", "The capital"]
    ids = [llm.tokenizer.encode(t) for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    by_text = llm.generate(texts, params, use_tqdm=False)
    by_ids = llm.generate(ids, params, use_tqdm=False)
    assert _tokens(by_text) == _tokens(by_ids) and [len(t) for t in _tokens(by_ids)] == [3, 5]
    assert _tokens(llm.generate(texts[1], params[1], use_tqdm=False)) == _tokens(by_ids)[1:]
    assert _tokens(llm.generate(ids[0], params[0], use_tqdm=False)) == _tokens(by_ids)[:1]
    # vLLM's prompt dicts: TokensPrompt (with its text, or without) and TextPrompt.
    by_dicts = llm.generate([{"prompt_token_ids": ids[0], "prompt": texts[0]},
                             {"prompt": texts[1]}], params, use_tqdm=False)
    assert _tokens(by_dicts) == _tokens(by_ids)
    assert [o.prompt for o in by_dicts] == texts
    one = llm.generate({"prompt_token_ids": ids[1]}, params[1], use_tqdm=False)
    assert _tokens(one) == _tokens(by_ids)[1:] and one[0].prompt is None
    with pytest.raises(ValueError, match=r"prompt: expected a dict with 'prompt' \(text\) "
                       r"or 'prompt_token_ids'.*got keys \['multi_modal_data', 'prompt'\]"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, use_tqdm=False)

    conv = [{"role": "user", "content": "How are you?"}]
    out = llm.chat(conv, params[0], use_tqdm=False)[0]
    hf = AutoTokenizer.from_pretrained(str(path))
    assert out.prompt_token_ids == hf.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert out.prompt == hf.apply_chat_template(conv, add_generation_prompt=True,
                                                tokenize=False)
    assert len(llm.chat([conv, conv], params[0], use_tqdm=False)) == 2
    # vLLM's keywords: continue_final_message and chat_template_kwargs (template
    # variables, as transformers' keyword arguments are).
    begun = [*conv, {"role": "assistant", "content": "I am"}]
    out = llm.chat(begun, params[0], use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True, chat_template_kwargs={"bos_token": "Hey"})[0]
    assert out.prompt == hf.apply_chat_template(
        begun, add_generation_prompt=False, continue_final_message=True, tokenize=False,
        bos_token="Hey")
    assert out.prompt.startswith("Hey") and out.prompt.endswith("I am")
    with pytest.raises(TypeError, match="chat_template_kwargs: expected a dict"):
        llm.chat(conv, params[0], use_tqdm=False, chat_template_kwargs=["x"])
    out = llm.chat(conv, params[0], use_tqdm=False,
                   chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}")[0]
    assert out.prompt == "<How are you?>"  # vLLM's chat_template: instead of the model's


def test_abort_frees_pages(checkpoint):
    path, _ = checkpoint
    llm = _llm(path)
    rid = llm.add_request(_prompts([30])[0], GREEDY)
    llm.step()
    assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks
    llm.abort_request(rid)
    _assert_pool_empty(llm)


def test_bad_input_errors(checkpoint, tmp_path):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="model: expected a directory with config.json"):
        _llm(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    odd = tmp_path / "gpt2"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="architectures.*LlamaForCausalLM.*GPT2LMHeadModel"):
        _llm(odd)
    bare = tmp_path / "noweights"
    bare.mkdir()
    shutil.copy(path / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match=r"\*\.safetensors weights"):
        _llm(bare)
    wide = tmp_path / "wide"
    shutil.copytree(path, wide)
    (wide / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=80)))
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight. shape: expected \(64, 80\), "
                                         r"got \(64, 96\)"):
        _llm(wide)
    for page_size in (24, 8, 512):
        with pytest.raises(ValueError, match=f"page_size: expected a power of two.*{page_size}"):
            _llm(path, page_size=page_size)
    with pytest.raises(ValueError, match="KV pool: expected >= 4 pages.*got 3 pages"):
        _llm(path, kv_cache_memory=3 * 16 * BYTES_PER_TOKEN)
    llm = _llm(path)
    with pytest.raises(ValueError, match="prompt length: expected at most max_model_len=64"):
        llm.generate([[5] * 65], GREEDY, use_tqdm=False)
    for empty in ("", []):
        with pytest.raises(ValueError, match="prompt: expected a non-empty"):
            llm.generate([empty], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"token ids in \[0, {VOCAB}\)"):
        llm.generate([[1, VOCAB]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"logit_bias: expected token ids in \[0, {VOCAB}\)"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len: expected an int from 1"):
        _llm(path, max_model_len=100000)
    assert not llm.has_unfinished_requests()  # a refused batch queues nothing


def test_finished_text_keeps_an_incomplete_last_character(checkpoint, monkeypatch):
    """Regression: a completion ending inside a multi-byte character lost its last
    bytes from .text (SmolLM2 answering in Japanese, cut by max_tokens); the finished
    text is now the decode of its tokens, as transformers gives it."""
    path, _ = checkpoint
    llm = _llm(path)
    forced = llm.tokenizer.encode(" €", add_special_tokens=False)[:-1]
    completed = llm.scheduler.completed

    def scripted(step, token_ids, logprobs):  # the sampled tokens replaced by `forced`
        forced_ids = [forced[i - s.num_prompt_tokens] for s, i in step.sampled]
        return completed(step, forced_ids, logprobs)

    monkeypatch.setattr(llm.scheduler, "completed", scripted)
    params = SamplingParams(temperature=0, max_tokens=len(forced), ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == forced and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(forced) and out.text.endswith("\ufffd")


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_cli_generate_streams_the_text(checkpoint, capsys, chat):
    from flashtile.cli import main
    path, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = _llm(path)
    if chat:
        want = llm.chat([{"role": "user", "content": "Hello world"}], params, use_tqdm=False)
    else:
        want = llm.generate("Hello world", params, use_tqdm=False)
    argv = ["generate", str(path), "--prompt", "Hello world", "--max-tokens", "8",
            "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--max-model-len", "64"]
    assert main(argv + ["--chat"] * chat) == 0
    captured = capsys.readouterr()
    assert captured.out == want[0].outputs[0].text + "\n"
    assert "[8 tokens in" in captured.err and "finish_reason=length" in captured.err


def test_seeded_sampling_is_batch_invariant(checkpoint):
    path, _ = checkpoint
    prompts = _prompts([5, 20, 11], seed=4)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s, max_tokens=12,
                             ignore_eos=True) for s in (1, 2, 3)]
    llm = _llm(path)
    alone = [_tokens(llm.generate([p], sp, use_tqdm=False))[0]
             for p, sp in zip(prompts, params)]
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == alone
    assert _tokens(llm.generate(prompts[::-1], params[::-1], use_tqdm=False)) == alone[::-1]
    assert len(set(map(tuple, alone))) == 3


class _EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay runs what a capture records,
    the model over the static inputs."""

    def __init__(self, runner, bs):
        self.replay = runner._decode_body(bs)


def _fake_graphs(llm, sizes):
    runner = llm.runner
    with torch.inference_mode():  # as _capture_graphs makes them: inference tensors
        runner.static_hidden = torch.zeros(runner.config.max_num_seqs,
                                           runner.config.model_config.hidden_size)
        runner.graphs = {bs: _EagerGraph(runner, bs) for bs in sizes}
    runner._graph_list = sorted(sizes)


def test_decode_graph_inputs_layout(checkpoint, monkeypatch):
    """Decode steps laid out as the CUDA graphs' static inputs (padded to the next graph
    size, copied in one buffer per dtype) give the eager tokens and logprobs. On CPU each
    'graph' runs the model over its static inputs."""
    path, _ = checkpoint
    prompts = _prompts([3, 2, 3, 25, 9], seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True)
              for n in (14, 12, 9, 6, 11)]
    want = [o.outputs[0] for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    # A 4-token budget: when the long prompt arrives beside three decodes, its first chunk
    # is one token, so the step is one token per sequence with a row that does not sample.
    llm = _llm(path, max_num_seqs=8, max_num_batched_tokens=4)
    _fake_graphs(llm, [1, 2, 4, 8])
    replays, replay = [], llm.runner._replay
    monkeypatch.setattr(llm.runner, "_replay", lambda bs: replays.append(bs) or replay(bs))
    partial, prepare = [], llm.runner.prepare

    def spy(scheduled):
        inputs = prepare(scheduled)
        partial.append(inputs.graph_bs is not None and inputs.logits_indices is not None)
        return inputs

    monkeypatch.setattr(llm.runner, "prepare", spy)
    got = _staggered(llm, prompts, params, {0: [0, 1, 2], 4: [3], 6: [4]})
    assert {4, 2, 1} <= set(replays) and any(partial)
    # prepare called outside inference mode (flashtile bench's decode timing does) still
    # fills the static inputs, which are inference tensors.
    seq = Sequence([5, 6, 7])
    assert llm.block_manager.allocate(seq)
    seq.num_computed_tokens = 2
    assert llm.runner.prepare([(seq, 1)]).graph_bs == 1
    llm.block_manager.free(seq)
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        torch.testing.assert_close(w.logprobs, g.logprobs, atol=1e-5, rtol=0)
    _assert_pool_empty(llm)


def _staggered(llm, prompts, params, arrivals):
    """Step llm, adding prompts[i] before step k for each i in arrivals[k]; the final
    CompletionOutputs in prompt order."""
    ids, done, step = {}, {}, 0
    while len(done) < len(prompts):
        for i in arrivals.get(step, []):
            ids[llm.add_request(prompts[i], params[i])] = i
        for out in llm.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0]
        step += 1
    return [done[i] for i in range(len(prompts))]


def _decode_reference(scheduled, rows, width, page_size, scratch):
    """A decode step rebuilt from its sequences alone, one row at a time, in the layout
    _host_decode documents: the packed (longs, ints) and the runs by name."""
    ids, pos, slots, seqlens, tables, sample, dst, src = ([] for _ in range(8))
    for b, (seq, _) in enumerate(scheduled):
        p, table = seq.num_computed_tokens, seq.block_table
        token = seq.token_ids[p]
        if token < 0:  # in flight
            dst.append(b)
            src.append(-1 - token)
            token = 0
        ids.append(token)
        pos.append(p)
        slots.append(table[p // page_size] * page_size + p % page_size)
        seqlens.append(p + 1)
        tables += table + [scratch] * (width - len(table))
        if p + 1 == len(seq.token_ids):
            sample.append(b)
    bs, pad = len(scheduled), rows - len(scheduled)
    logits_indices = sample if len(sample) < bs else []
    longs = (ids + [0] * pad + pos + [0] * pad + slots + [-1] * pad + logits_indices
             + dst + src)
    cu_k = list(itertools.accumulate(seqlens, initial=0))
    ints = seqlens + [1] * pad + tables + [scratch] * (width * pad) + list(range(bs + 1)) \
        + cu_k
    runs = dict(input_ids=ids, positions=pos, slot_mapping=slots, dst=dst, src=src,
                cache_seqlens=seqlens, block_tables=tables, cu_seqlens_k=cu_k)
    if logits_indices:
        runs["logits_indices"] = logits_indices
    return longs, ints, runs


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_decode_inputs_equal_a_rebuild(checkpoint, graphs):
    """Decode steps gather their block tables from BlockManager.tables, rows kept as
    tables change, and build the rest with numpy: each step's buffers equal a rebuild
    from the sequences, row by row, through preemptions (rows freed and reused),
    prefix-cache hits (rows starting with shared pages), sequences ending mid-batch
    and pages added; so do the buffers built from the lists (block_manager None, the
    warm-up's way)."""
    path, _ = checkpoint
    shared = _prompts([20], seed=8)[0]  # one full page in common
    prompts = _prompts([3, 41, 9, 30, 17], seed=1) + [shared + [4, 5], shared + [6]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (20, 9, 14, 20, 5, 18, 12)]
    llm = _llm(path, max_num_seqs=8, max_num_batched_tokens=16,
               kv_cache_memory=6 * 16 * BYTES_PER_TOKEN)
    runner, bm = llm.runner, llm.block_manager
    if graphs:
        _fake_graphs(llm, [1, 2, 4, 8])
    host_decode, batches, cached = runner._host_decode, [], []

    def spy(scheduled):
        bm.check_invariants()  # the rows equal the lists
        host = host_decode(scheduled)
        runner.block_manager = None
        from_lists = host_decode(scheduled)
        runner.block_manager = bm
        rows = host.graph_bs or host.batch
        longs, ints, runs = _decode_reference(scheduled, rows, host.width, runner.page_size,
                                              runner.scratch_block)
        for h in (host, from_lists):
            assert (h.longs.tolist(), h.ints.tolist()) == (longs, ints)
            got = {name: h.longs[o:o + n].tolist() for name, (o, n) in h.o64.items()}
            got.update((name, h.ints[o:o + n].tolist()) for name, (o, n) in h.o32.items())
            got["block_tables"] = got["block_tables"][:len(scheduled) * host.width]
            del got["cu_seqlens_q"]
            assert got == runs
        batches.append(tuple(seq.seq_id for seq, _ in scheduled))
        cached.extend(seq.num_cached_tokens for seq, _ in scheduled)
        return host

    runner._host_decode = spy
    arrivals = {0: [0, 1, 5], 3: [2, 3], 5: [4], 7: [6]}
    _staggered(llm, prompts, params, arrivals)
    assert llm.scheduler.num_preemptions > 0 and max(cached) >= 16
    assert len(set(batches)) > 5  # sequences joined and left between decode steps
    _assert_pool_empty(llm)
    assert sorted(bm._free_rows) == list(range(len(bm.tables)))
    assert (bm.tables == bm.num_blocks).all()


def test_warm_up_runs_every_step_kind(checkpoint, monkeypatch):
    """ModelRunner.warm_up (run on CUDA before serving, so that no kernel compiles while
    serving) goes through fresh prefill, paged prefill beside a decode, and decode, with
    the varlen kernel's int arguments rounded to multiples of 16 (one compiled variant),
    and touches no sequence's pages."""
    path, _ = checkpoint
    llm = _llm(path, max_num_batched_tokens=100)
    runner, kinds = llm.runner, set()
    forward = runner.forward

    def spy(inputs):
        m = inputs.meta
        kinds.add("decode" if m.is_decode else "paged" if m.has_context else "fresh")
        if not m.is_decode:
            assert m.max_seqlen_q % 16 == 0 and m.block_tables.shape[1] % 16 == 0
        assert (m.slot_mapping // runner.page_size == runner.scratch_block).all()
        return forward(inputs)

    monkeypatch.setattr(runner, "forward", spy)
    runner.warm_up()
    assert kinds == {"fresh", "paged", "decode"}
    _assert_pool_empty(llm)


def test_warm_up_decodes_each_split_variant(checkpoint, monkeypatch):
    """An eager warm-up runs a decode step at each (batch, block-table width) that
    flashtile's paged_decode_warm_shapes names for the engine's batch sizes and the
    widths _host_decode gives (multiples of 16 pages), so that no split-decode variant
    compiles while serving; the steps touch no sequence's pages."""
    from flashtile.engine import runner as runner_module
    path, _ = checkpoint
    llm = _llm(path, max_model_len=200, max_num_seqs=5)  # 13 pages: width 16
    runner, asked, decodes = llm.runner, [], []
    forward = runner.forward

    def shapes(q, k_cache, v_cache, batch_sizes, widths):
        asked.append((q.shape, k_cache.data_ptr() == runner.kv_cache[0, 0].data_ptr(),
                      list(batch_sizes), list(widths)))
        return [(3, 16), (5, 16)]

    def spy(inputs):
        if inputs.meta.is_decode:
            decodes.append(tuple(inputs.meta.block_tables.shape))
        return forward(inputs)

    monkeypatch.setattr(runner_module, "paged_decode_warm_shapes", shapes)
    monkeypatch.setattr(runner, "forward", spy)
    runner.warm_up()
    mc = runner.config.model_config
    assert asked == [((1, 1, mc.num_attention_heads, mc.head_dim), True, [1, 2, 3, 4, 5],
                      [16])]
    assert decodes[-2:] == [(3, 16), (5, 16)]
    _assert_pool_empty(llm)


def test_async_scheduling_equals_sync(checkpoint, tmp_path, async_scheduling, monkeypatch):
    """Asynchronous scheduling (each step launched before the previous one's tokens are
    read; in-flight tokens read on the device) gives the synchronous engine's tokens,
    texts, finish reasons and logprobs: greedy, seeded sampling, a repetition penalty,
    end-of-sequence and stop-token/stop-string ends (whose next step, already launched,
    is discarded), staggered arrivals, chunked prefill, preemption and an abort; and
    every page comes back."""
    if not async_scheduling:
        pytest.skip("runs both modes itself")
    path, _ = checkpoint
    text_prompt = "The capital of France is"
    free = _llm(path).generate(text_prompt, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    (eos_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": free.token_ids[6]}))
    prompts = _prompts([3, 41, 9, 30, 17, 5, 22, 12], seed=7) + [text_prompt] * 2
    prompts[5] = text_prompt  # meets its stop token id
    greedy = dict(temperature=0, logprobs=0)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **greedy),
              SamplingParams(max_tokens=14, **greedy),  # may meet the end-of-sequence id
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=18, logprobs=0),
              SamplingParams(max_tokens=16, repetition_penalty=1.3, **greedy),
              SamplingParams(temperature=1.1, top_k=20, seed=9, max_tokens=15, logprobs=0),
              SamplingParams(max_tokens=12, stop_token_ids=[free.token_ids[2]], **greedy),
              SamplingParams(max_tokens=30, ignore_eos=True, **greedy),  # aborted
              SamplingParams(max_tokens=None, **greedy),  # up to max_model_len
              SamplingParams(max_tokens=24, stop=[free.text[8:11]], ignore_eos=True,
                             **greedy),
              SamplingParams(max_tokens=24, **greedy)]  # the end-of-sequence id
    arrivals = {0: [0, 1, 2], 2: [3, 4], 5: [5, 6, 7], 9: [8, 9]}
    runs, discarded = {}, []
    completed = Scheduler.completed

    def spy(self, step, token_ids, logprobs):
        discarded.extend(seq for seq, _ in step.sampled if seq.is_finished)
        return completed(self, step, token_ids, logprobs)

    monkeypatch.setattr(Scheduler, "completed", spy)
    gathered, gather = {False: 0, True: 0}, ModelRunner._gather_ids

    def count(self, input_ids, dst, src):
        gathered[mode] += len(dst)
        return gather(self, input_ids, dst, src)

    monkeypatch.setattr(ModelRunner, "_gather_ids", count)
    for mode in (False, True):
        llm = _llm(eos_dir, async_scheduling=mode, max_num_batched_tokens=16,
                   kv_cache_memory=8 * 16 * BYTES_PER_TOKEN)
        ids, done, step = {}, {}, 0
        while step < 10 or llm.has_unfinished_requests():
            for i in arrivals.get(step, []):
                ids[llm.add_request(prompts[i], params[i])] = i
            if step == 12:
                llm.abort_request(next(r for r, i in ids.items() if i == 6))
            for out in llm.step():
                assert out.request_id in llm._requests or out.finished
                if out.finished:
                    done[ids[out.request_id]] = out.outputs[0]
            step += 1
        assert sorted(done) == [0, 1, 2, 3, 4, 5, 7, 8, 9]  # 6 was aborted
        assert llm.scheduler.num_preemptions > 0
        _assert_pool_empty(llm)
        runs[mode] = done
    reasons = {i: o.finish_reason for i, o in runs[False].items()}
    assert reasons[5] == reasons[8] == reasons[9] == "stop" and reasons[7] == "length"
    assert len(runs[False][7].token_ids) == 64 - 12  # max_model_len - prompt
    assert discarded  # some sequence ended while its next step was already launched
    assert gathered[False] == 0 and gathered[True] > 50  # in-flight ids read on device
    for i, want in runs[False].items():
        got = runs[True][i]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), i
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_prefill_inputs_start_16_byte_aligned(checkpoint, batch):
    """Regression (run E5 on the H200): the step's index tensors are views of one packed
    buffer, and Triton specialises pointer arguments on 16-byte alignment; cu_seqlens_k
    after batch + 1 int32s and the block table after it were aligned for some batch sizes
    only, so new kernel variants compiled while serving. Every view now starts at a
    multiple of 16 bytes (the device buffer itself is allocator-aligned)."""
    path, _ = checkpoint
    llm = _llm(path, page_size=16)
    scheduled = []
    for i in range(batch):
        seq = Sequence(list(range(1, 4 + 7 * i)), GREEDY)
        assert llm.block_manager.allocate(seq)
        scheduled.append((seq, seq.num_tokens - 2 * (i % 2)))  # some chunks end early
    inputs = llm.runner.prepare(scheduled)
    meta = inputs.meta
    views = dict(input_ids=inputs.input_ids, positions=inputs.positions,
                 logits_indices=inputs.logits_indices, slot_mapping=meta.slot_mapping,
                 cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                 cache_seqlens=meta.cache_seqlens, block_tables=meta.block_tables)
    for name, t in views.items():
        assert t.storage_offset() * t.element_size() % 16 == 0, name
    assert meta.cu_seqlens_k.tolist() == [0, *itertools.accumulate(
        seq.num_computed_tokens + n for seq, n in scheduled)]
    for seq, _ in scheduled:
        llm.block_manager.free(seq)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the GEMV on CPU needs the interpreter (make test)")
@pytest.mark.parametrize("fuse", [False, True], ids=["gemv", "gemv-fused"])
def test_gemv_steps_give_the_same_tokens(checkpoint, monkeypatch, fuse):
    """Steps of one or two tokens through the GEMV (engine/gemv.py; fuse: with the norms
    and SiLU-and-multiply inside it, FLASHTILE_ENGINE_GEMV_FUSE) and the CUDA path's
    elementwise kernels, forced on through the interpreter, two sequences at most a step:
    the same greedy tokens as the PyTorch path."""
    import flashtile.engine.gemv as gemv_module
    import flashtile.engine.model as model
    from tests.test_engine_gemv import gemv_steps
    path, _ = checkpoint
    prompts = _prompts([5, 23, 40], seed=5)
    want = _tokens(_llm(path, max_num_seqs=2).generate(prompts, GREEDY, use_tqdm=False))
    monkeypatch.setattr(model, "use_kernels", lambda x: True)
    prologues = gemv_steps(monkeypatch, fuse, on_cpu=True)
    llm = _llm(path, max_num_seqs=2)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    fused = {gemv_module.NORM, gemv_module.ADD_NORM, gemv_module.SILU}
    assert gemv_module.NONE in prologues and (fused <= set(prologues)) is fuse
    _assert_pool_empty(llm)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernel on CPU needs the interpreter (make test)")
@pytest.mark.parametrize("kw", [{}, dict(attention_backend="naive")], ids=["flashtile", "naive"])
def test_elementwise_kernels_give_the_same_tokens(checkpoint, monkeypatch, kw):
    """The CUDA path's layers (the Triton kernels of RMSNorm with the residual add,
    SiLU-and-multiply, and the rotary embedding with the cache write: engine/layernorm.py,
    activation.py, rope_store.py) forced on through the interpreter: the same greedy
    tokens as the PyTorch path, with chunked prefill beside decodes and a shared
    prefix."""
    import flashtile.engine.model as model
    path, _ = checkpoint
    prompts = _prompts([5, 23, 40], seed=4)
    prompts.append(prompts[1][:16] + [7, 8])  # a prefix-cache hit
    want = _tokens(_llm(path, **kw).generate(prompts, GREEDY, use_tqdm=False))
    monkeypatch.setattr(model, "use_kernels", lambda x: True)
    llm = _llm(path, max_num_batched_tokens=32, **kw)  # chunked prefill beside decodes
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
