"""LLM(tensor_parallel_size=2), the multi-process driver (engine/workers.py) on CPU: this
process is rank 0 and starts a worker process; gloo joins them.

Greedy and seeded generate at tensor_parallel_size=2 give the tokens (and logprobs, to
1e-5) of one process, with chunked prefill and prefix-cache hits, in both scheduling
modes, with messages larger than the shared buffer, behind the server and on the command
line; a worker that fails (while loading, or killed between steps) is a RuntimeError in
rank 0 within seconds; rank 0's own error is raised as it is; shutdown leaves no process,
no process group and no shared memory behind. A 2-GPU test (NCCL, CUDA graphs) is marked
gpu.
"""

from __future__ import annotations

import dataclasses

import multiprocessing
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from flashtile.engine import LLM, workers
from flashtile.engine.block_manager import BlockManager
from flashtile.engine.channel import CAPACITY, Channel
from flashtile.engine.sampling_params import SamplingParams
from tests.engine_utils import VOCAB, ServerThread, engine_cpu, hf_config, \
    make_checkpoint, make_tokenizer

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
# fp32 on flashtile's torch path; a 16-token budget prefills the longer prompts in chunks.
LLM_KW = dict(dtype="float32", device="cpu", max_model_len=64, page_size=16,
              max_num_batched_tokens=16)
# name -> (engine_utils case, config overrides, LLM overrides, channel buffer bytes)
DRIVER_CASES = {
    "llama-gqa-untied-sync": ("llama", {}, dict(async_scheduling=False), CAPACITY),
    # A buffer of 512 bytes: the steps' messages are sent in several chunks.
    "qwen2-bias-tied-async-chunked": ("qwen2-bias", dict(tie_word_embeddings=True),
                                      dict(async_scheduling=True), 512),
}


class _MeasuredChannel(Channel):
    """A Channel of the case's buffer size that records the size of each message."""

    capacity_bytes, sizes = CAPACITY, []

    def __init__(self, ctx, readers):
        super().__init__(ctx, readers, self.capacity_bytes)

    def send(self, obj, timeout_s):
        self.sizes.append(len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))
        super().send(obj, timeout_s)


def _no_engine_left(shm_name):
    assert multiprocessing.active_children() == [] and not dist.is_initialized()
    assert not os.path.exists(f"/dev/shm/{shm_name}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(DRIVER_CASES))
def test_tp2_generate_equals_one_process(tmp_path, monkeypatch, name):
    case, overrides, kw, capacity = DRIVER_CASES[name]
    make_checkpoint(tmp_path, case, **overrides)
    monkeypatch.setattr(_MeasuredChannel, "capacity_bytes", capacity)
    monkeypatch.setattr(_MeasuredChannel, "sizes", [])
    monkeypatch.setattr(workers, "Channel", _MeasuredChannel)
    one = LLM(str(tmp_path), **LLM_KW, **kw)
    two = LLM(str(tmp_path), tensor_parallel_size=2, **LLM_KW, **kw)
    shm = two.runner.workers.channel.shm.name
    assert two.runner.model.tp.size == 2 and two.runner.num_blocks == one.runner.num_blocks
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, VOCAB, (35,), generator=g).tolist()  # two full pages
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 23, 41)]
    prompts += [shared + [5], shared + [7, 8, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=8, logprobs=0,
                            ignore_eos=True)
    # Prompt logprobs on one prompt: the LM head's gather over its chunks' rows.
    scored = dataclasses.replace(greedy, prompt_logprobs=2)
    params = [greedy, greedy, scored, greedy, greedy, seeded]
    cached = []
    allocate = BlockManager.allocate

    def spy(self, seq):  # rank 0's block manager: the only one
        ok = allocate(self, seq)
        cached.append(seq.num_cached_tokens)
        return ok

    monkeypatch.setattr(BlockManager, "allocate", spy)
    runs = {}
    try:
        for llm in (one, two):
            # Twice: the second time every prompt of two full pages or more hits the cache.
            runs[llm] = [o for _ in range(2)
                         for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        two.shutdown()
    _no_engine_left(shm)
    assert max(cached) == 32
    assert max(_MeasuredChannel.sizes) > 2 * capacity or capacity == CAPACITY
    for want, got in zip(runs[one], runs[two], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        torch.testing.assert_close(got.outputs[0].logprobs, want.outputs[0].logprobs,
                                   atol=1e-5, rtol=0)
        assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
        if want.prompt_logprobs is not None:
            assert [list(x or ()) for x in got.prompt_logprobs] == \
                [list(x or ()) for x in want.prompt_logprobs]
            torch.testing.assert_close([list((x or {}).values()) for x in got.prompt_logprobs],
                                       [list((x or {}).values()) for x in want.prompt_logprobs],
                                       atol=1e-5, rtol=0)
    assert sum(o.prompt_logprobs is not None for o in runs[two]) == 2
    assert len({tuple(o.outputs[0].token_ids) for o in runs[two]}) > 3


@pytest.mark.timeout(120)
def test_tp2_behind_the_server_and_shut_down_with_it(tmp_path):
    """flashtile serve's engine over 2 processes answers like one; stopping the server
    stops the workers."""
    aiohttp = pytest.importorskip("aiohttp")
    from flashtile.engine.server import AsyncEngine, build_app
    make_checkpoint(tmp_path, "llama")
    make_tokenizer(tmp_path)
    prompt = "The capital of France is"
    want = LLM(str(tmp_path), **LLM_KW).generate(prompt, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    engine = AsyncEngine(lambda: LLM(str(tmp_path), tensor_parallel_size=2, **LLM_KW))
    shm = engine.llm.runner.workers.channel.shm.name

    async def complete(url):
        async with aiohttp.ClientSession() as session:
            body = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                        ignore_eos=True)
            async with session.post(url + "/v1/completions", json=body) as r:
                return r.status, await r.json()

    import asyncio
    with ServerThread(build_app(engine, "tiny")) as server:
        status, body = asyncio.run(asyncio.wait_for(complete(server.url), 60))
    assert status == 200 and body["choices"][0]["text"] == want
    _no_engine_left(shm)


def _worker_failing_to_load(*args):
    """workers.worker_main with a checkpoint reader that fails (in the worker only)."""
    from flashtile.engine import loader

    def unreadable(model, model_dir):
        raise OSError("rank 1 cannot read its shard")

    loader.load_weights = unreadable
    workers.worker_main(*args)


@pytest.mark.timeout(120)
def test_worker_failing_to_load_raises_in_rank_0(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, "llama")
    monkeypatch.setattr(workers, "worker_main", _worker_failing_to_load)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 failed:\n"
                       r"Traceback(.|\n)*OSError: rank 1 cannot read its shard"):
        LLM(str(tmp_path), tensor_parallel_size=2, **LLM_KW)
    assert time.monotonic() - start < 60  # rank 0 loaded, then its all_reduce failed
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


@pytest.mark.timeout(120)
def test_pool_too_small_is_a_value_error_on_every_rank(tmp_path):
    """Every rank takes the smallest pool, so all refuse it alike: rank 0 raises its own
    ValueError (not a worker's failure) and stops the worker."""
    hf_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"KV pool: expected >= 4 pages of 16 tokens .* "
                       r"got 2 pages \(8192 bytes\)"):
        LLM(str(tmp_path), tensor_parallel_size=2, load_format="dummy",
            kv_cache_memory=8192, **LLM_KW)
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("watcher", [True, False], ids=["watched", "unwatched"])
def test_dead_worker_raises_in_rank_0(tmp_path, monkeypatch, watcher):
    """A killed worker fails the next step with its exit code, stops the engine, and
    every later call says a rank failed. Unwatched: the monitor thread never marks the
    dead worker (it lost the race to the failing step, as it may), and the step's own
    failure path must say so."""
    if not watcher:
        monkeypatch.setattr(workers.Workers, "_watch", lambda self: None)
    hf_config("llama").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, load_format="dummy", **LLM_KW)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    shm, (pid,) = llm.runner.workers.channel.shm.name, llm.runner.workers.pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"tensor-parallel worker rank 1 \\(pid {pid}\\) "
                       "exited with code -9"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert time.monotonic() - start < 30
    _no_engine_left(shm)  # a failure stops the engine
    with pytest.raises(RuntimeError, match=r"workers are stopped \(a rank failed\)"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.shutdown()  # nothing left to do


@pytest.mark.gpu
@pytest.mark.timeout(300)  # a collective that never completes fails the test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tp2_on_two_gpus_equals_one(tmp_path, monkeypatch, enforce_eager):
    """NCCL, rank r on cuda:r, asynchronous scheduling, and decode eager or replayed in
    CUDA graphs holding the all_reduces: greedy tokens of 2 GPUs equal one GPU's."""
    monkeypatch.delenv("FLASHTILE_BACKEND")  # flashtile's kernels, in the workers too
    make_checkpoint(tmp_path, "llama")
    kw = dict(dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=32, kv_cache_memory=2**26, enforce_eager=enforce_eager)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 30, 61)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    want = [o.outputs[0] for o in LLM(str(tmp_path), **kw).generate(prompts, params,
                                                                    use_tqdm=False)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **kw)
    try:
        assert llm.config.async_scheduling
        assert sorted(llm.runner.graphs) == ([] if enforce_eager else [1, 2, 4, 8])
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    for w, o in zip(want, got):
        assert o.token_ids == w.token_ids
        torch.testing.assert_close(o.logprobs, w.logprobs, atol=1e-4, rtol=0)
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


@pytest.mark.timeout(120)
def test_command_line_tensor_parallel_size(tmp_path, monkeypatch, capsys):
    """flashtile generate -tp 2 streams one process's text; flashtile serve passes
    --tensor-parallel-size to the engine."""
    from flashtile.cli import main
    from flashtile.engine import llm as llm_module
    make_checkpoint(tmp_path, "llama")
    make_tokenizer(tmp_path)
    args = ["generate", str(tmp_path), "--prompt", "Hello world", "--max-tokens", "5",
            "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--max-model-len", "64"]
    texts = []
    for extra in ([], ["-tp", "2"]):
        assert main(args + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 1
    assert multiprocessing.active_children() == []

    def refuse(model, **kw):
        raise ValueError(f"tensor_parallel_size={kw['tensor_parallel_size']}")

    monkeypatch.setattr(llm_module, "LLM", refuse)
    pytest.importorskip("aiohttp")
    assert main(["serve", str(tmp_path), "--tensor-parallel-size", "2"]) == 2
    assert "tensor_parallel_size=2" in capsys.readouterr().err
