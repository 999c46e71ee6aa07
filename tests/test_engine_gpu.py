"""flashtile.engine on CUDA (make test-gpu): CUDA-graph decode against eager decode,
greedy tokens against transformers, the pool sized from free memory, and bf16 top-1
agreement with transformers at a real model's scale (the rate is printed).

make test-gpu runs 8 pytest workers on one GPU, so the tests give the pool a fixed
kv_cache_memory, and the sizing test sees only its own process's memory as in use."""

from __future__ import annotations

import pytest
import torch

from flashtile.engine import LLM, SamplingParams
from tests.engine_utils import VOCAB, hf_greedy, make_checkpoint, make_tokenizer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gpu")
    return path, make_checkpoint(path, "llama")


def _prompts(lengths, vocab=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _graphs_equal_eager(path, monkeypatch, lengths, max_tokens, replayed, env=None,
                        **kw):
    """Greedy generation with decode CUDA graphs (env: variables set before the graphed
    engine is built) gives the eager engine's tokens and logprobs, replays at least the
    ``replayed`` batch sizes, and frees every block. Returns the graphed LLM."""
    kw = {**dict(dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
                 kv_cache_memory=2**28), **kw}
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True)
              for n in max_tokens]
    prompts = _prompts(lengths)
    eager = _generate(LLM(str(path), enforce_eager=True, **kw), prompts, params)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    llm = LLM(str(path), **kw)
    assert sorted(llm.runner.graphs) == [1, 2, 4, 8]
    replays = []
    replay = llm.runner._replay
    monkeypatch.setattr(llm.runner, "_replay", lambda bs: replays.append(bs) or replay(bs))
    graphed = _generate(llm, prompts, params)
    assert set(replayed) <= set(replays)
    for e, g in zip(eager, graphed):
        assert e.token_ids == g.token_ids
        torch.testing.assert_close(e.logprobs, g.logprobs, atol=1e-4, rtol=0)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return llm


@pytest.mark.parametrize("backend", ["flashtile", "sdpa", "naive"])
def test_cuda_graph_decode_equals_eager(checkpoint, monkeypatch, backend):
    # Batch 3 replays the graph of 4 (one padding row), then 2 and 1 as requests end.
    _graphs_equal_eager(checkpoint[0], monkeypatch, [3, 40, 77], (24, 12, 6), {4, 2, 1},
                        attention_backend=backend)


@pytest.mark.parametrize("kv_cache_dtype,calculate", [("fp8", False), ("fp8_e5m2", False),
                                                      ("fp8", True)])
def test_fp8_kv_cache_graphs_and_eager_agree(checkpoint, kv_cache_dtype, calculate):
    """kv_cache_dtype="fp8" on the GPU (bf16 model): the rotary kernel quantising into
    the pool, the varlen forward widening it under bf16 queries, the paged decode over
    it, eagerly and in decode graphs (calculate: the scales set by the first step, which
    the captured graphs read in place). The first tokens come from the same eager prefill
    and must be equal; later ones may differ where bf16 rounds the padded graph batch
    otherwise (the rates are printed), as may the tokens over a bf16 pool."""
    path, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts([9, 40, 70], seed=3)
    kw = dict(dtype="bfloat16", device="cuda", max_model_len=128, kv_cache_memory=2**28,
              calculate_kv_scales=calculate)
    runs = {}
    for name, extra in (("eager", dict(enforce_eager=True)), ("graphs", {}),
                        ("bf16 pool", dict(kv_cache_dtype="auto",
                                           calculate_kv_scales=False))):
        llm = LLM(str(path), **{**kw, "kv_cache_dtype": kv_cache_dtype, **extra})
        if name == "graphs":
            assert llm.runner.graphs and llm.runner.kv_cache.dtype.itemsize == 1
        runs[name] = [o.token_ids for o in _generate(llm, prompts, params)]
        bm = llm.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    eager = runs["eager"]
    for name, tokens in runs.items():
        same = sum(x == y for a, b in zip(eager, tokens) for x, y in zip(a, b))
        print(f"{kv_cache_dtype} pool, eager: {same} of {16 * len(prompts)} greedy tokens "
              f"as {name}'s")
    assert [t[0] for t in runs["graphs"]] == [t[0] for t in eager]
    same = sum(x == y for a, b in zip(eager, runs["graphs"]) for x, y in zip(a, b))
    assert same >= 0.75 * 16 * len(prompts)


def test_torch_backend_decodes_eagerly(checkpoint, monkeypatch):
    """FLASHTILE_BACKEND=torch reads sequence lengths on the host, which a CUDA graph
    capture forbids: the engine then decodes eagerly, with the graphed engine's tokens."""
    path, _ = checkpoint
    kw = dict(dtype="float32", device="cuda", max_model_len=64, max_num_seqs=4,
              kv_cache_memory=2**26)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts([5, 17])
    graphed = _generate(LLM(str(path), **kw), prompts, params)
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    llm = LLM(str(path), **kw)
    assert llm.runner.graphs == {}
    assert [o.token_ids for o in _generate(llm, prompts, params)] == \
        [o.token_ids for o in graphed]


def test_greedy_equals_transformers_on_cuda(checkpoint):
    path, model = checkpoint
    prompts = _prompts([1, 9, 30, 61])
    # A 32-token budget: the 61-token prompt is prefilled in chunks over the pool.
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, kv_cache_memory=2**28)
    got = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.token_ids for o in got] == [hf_greedy(model, p, 16) for p in prompts]


def test_pool_sized_from_free_memory(checkpoint, monkeypatch):
    path, _ = checkpoint
    _, total = torch.cuda.mem_get_info()
    # As if this process were alone on the device (other workers share it).
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (total - torch.cuda.memory_reserved(), total))
    util = 0.02
    held = torch.cuda.memory_reserved()  # by this worker's earlier tests
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=128,
              gpu_memory_utilization=util, enforce_eager=True)
    pool = llm.runner.kv_cache.numel() * llm.runner.kv_cache.element_size()
    assert llm.runner.num_blocks >= llm.config.blocks_per_seq
    assert pool <= util * total
    # A tiny model and a short warm-up: nearly all of the fraction goes to the pool.
    assert pool >= util * total - held - 2**30


@pytest.mark.slow
@torch.no_grad()
def test_bf16_top1_agreement_with_transformers_at_scale(tmp_path):
    """A Llama-3.2-1B-like width (2048 hidden, 32/8 heads) with 8 layers and a 32k vocab,
    transformers' own random init, bf16. Teacher-forced: transformers' argmax at each
    position of the engine's greedy continuation against the engine's token."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=1024, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    model = model.cuda()
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=1024,
              max_num_seqs=16, kv_cache_memory=2**32)
    prompts = _prompts([50, 97, 150, 211, 256, 300, 64, 128], vocab=32000)
    outs = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=32,
                                                  ignore_eos=True))
    agree = total = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids], device="cuda")
        hf_top1 = model(ids).logits[0, len(p) - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(hf_top1, o.token_ids))
        total += len(o.token_ids)
    rate = agree / total
    print(f"\nbf16 top-1 agreement with transformers: {agree}/{total} = {rate:.3f}")
    assert rate >= 0.9


def test_async_scheduling_equals_sync_with_cuda_graphs(checkpoint):
    """Asynchronous scheduling on CUDA (decode steps replayed in CUDA graphs whose input
    ids are gathered on the device from the previous step's sampled ids, tokens read one
    step later through pinned memory and an event) gives the synchronous tokens, with
    chunked prefill beside decodes, staggered ends, seeded sampling and a request that
    stops at the end-of-sequence id if it meets it."""
    path, _ = checkpoint
    kw = dict(dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=32, kv_cache_memory=2**28)
    prompts = _prompts([3, 40, 77, 9, 21, 5])
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True)
              for n in (24, 12, 6, 30, 17, 9)]
    params.append(SamplingParams(temperature=0, max_tokens=40, logprobs=0))
    params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20,
                                 logprobs=0))
    prompts += _prompts([14, 33], seed=1)
    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, **kw)
        assert llm.runner.graphs and llm.config.async_scheduling == mode
        runs[mode] = _generate(llm, prompts, params)
        bm = llm.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()
    for s, a in zip(runs[False], runs[True]):
        assert s.token_ids == a.token_ids and s.finish_reason == a.finish_reason
        torch.testing.assert_close(s.logprobs, a.logprobs, atol=1e-4, rtol=0)
    assert LLM(str(path), **kw).config.async_scheduling  # the default on CUDA


def test_sampling_options_with_graphs_and_async_equal_eager_sync(checkpoint, tmp_path):
    """Penalties (repetition, frequency, presence), a logit bias, n = 2 seeded, top-k
    logprobs, min_tokens (half the vocabulary as stop ids, masked for 6 tokens) and bad
    words (one of two tokens, its first pushed by a bias, so its bans read the tokens
    in flight) on CUDA: the default engine (CUDA-graph decode, asynchronous scheduling,
    which must wait for the tokens a penalty or a bad word reads) gives the tokens and
    alternatives of an eager, synchronous one."""
    import shutil

    from flashtile.engine.tokenizer import Tokenizer

    path = tmp_path / "with-tokenizer"  # bad words need one; the module's has none
    shutil.copytree(checkpoint[0], path)
    make_tokenizer(path)
    zz = Tokenizer(str(path)).encode("zz", add_special_tokens=False)  # two tokens
    kw = dict(dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
              kv_cache_memory=2**28)
    params = [SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
                             logit_bias={5: 3.0}, max_tokens=16, logprobs=3,
                             ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, n=2, repetition_penalty=1.2,
                             max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=6,
                             stop_token_ids=list(range(3, VOCAB, 2))),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                             bad_words=["zz"], logit_bias={zz[0]: 30.0})]
    prompts = _prompts([5, 30, 12, 7])
    runs = []
    for eager in (True, False):
        llm = LLM(str(path), enforce_eager=eager, async_scheduling=not eager, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([c for o in outs for c in o.outputs])
        bm = llm.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert [len(r) for r in runs] == [5, 5]
    barred = runs[0][-1].token_ids  # the bias pushed "zz"'s first token, the rule held
    assert barred.count(zz[0]) >= 3 and (zz[0], zz[1]) not in zip(barred, barred[1:])
    for e, g in zip(*runs):
        assert e.token_ids == g.token_ids
        assert (e.top_logprobs is None) == (g.top_logprobs is None)
        for a, b in zip(e.top_logprobs or [], g.top_logprobs or []):
            assert list(a) == list(b)
            torch.testing.assert_close(list(a.values()), list(b.values()), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_prompt_logprobs_with_graphs_and_async_equal_transformers(checkpoint):
    """SamplingParams.prompt_logprobs on CUDA (fp32): chunked prefill beside graphed
    decodes and asynchronous scheduling give transformers' prompt distribution, and the
    completions equal those of requests without prompt logprobs."""
    from tests.test_engine_generate import _check_prompt_logprobs

    path, model = checkpoint
    kw = dict(dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=32, kv_cache_memory=2**28)
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts([70, 5, 33], seed=3)
    llm = LLM(str(path), **kw)
    plain = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    outs = llm.generate(prompts, [SamplingParams(prompt_logprobs=k, **base)
                                  for k in (2, 0, None)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert outs[2].prompt_logprobs is None
    for out, k in zip(outs[:2], (2, 0)):
        _check_prompt_logprobs(model, out, k, atol=1e-3)  # CUDA's fp32 products
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
