"""Tensor parallelism: the model split over 2 processes (gloo on CPU, the same code NCCL
runs on GPUs) computes what one process computes.

Layers and runner: each rank builds a ModelRunner at tensor_parallel_size=2 over a
random-initialised transformers checkpoint (GQA, qkv bias, tied embeddings over a
vocabulary that does not split evenly, Qwen3's q/k norms in a sharded checkpoint) or
dummy weights, and runs a packed prefill with a chunked prompt, a step mixing decodes with
the chunk's rest (paged prefill), and a pure decode step over its half of the KV pool.
Every rank's logits must equal the single-process model's (fp32, 1e-5).

The driver (engine/workers.py): LLM(tensor_parallel_size=2) starts a worker process and
generates the tokens of LLM(tensor_parallel_size=1), greedy and seeded, with chunked
prefill and prefix-cache hits, in both scheduling modes, also behind the server; a worker
that fails (while loading, or killed between steps) is a RuntimeError in rank 0 within
seconds; shutdown leaves no process, no process group and no shared memory behind.
"""

from __future__ import annotations

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
from flashtile.engine.config import EngineConfig, ModelConfig
from flashtile.engine.model import CausalLM
from flashtile.engine.parallel import SINGLE, ColumnParallelLinear, ParallelGroup, \
    QKVParallelLinear, RowParallelLinear, group_size
from flashtile.engine.runner import ModelRunner
from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.sequence import Sequence
from tests.engine_utils import VOCAB, ServerThread, engine_cpu, hf_config, \
    make_checkpoint, make_tokenizer
from tests.utils import run_gloo

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
WORLD = 2
SPAWN_TIMEOUT_S = 120  # a hung child fails the test then; gloo gives up at 60 s itself
# name -> (engine_utils case, config overrides, EngineConfig overrides); "dummy" cases
# have only config.json.
CASES = {
    "llama-gqa": ("llama", {}, {}),
    "qwen2-bias": ("qwen2-bias", {}, {}),
    "llama-tied-odd-vocab": ("llama3-rope-tied", dict(vocab_size=VOCAB + 1), {}),
    "qwen3-qk-norm-sharded": ("qwen3-sharded", {}, {}),
    "dummy-tied-odd-vocab": ("llama3-rope-tied", dict(vocab_size=VOCAB + 1),
                             dict(load_format="dummy", seed=3)),
}


def _runner(path, **kw):
    kw = dict(dtype="float32", device="cpu", max_model_len=64, page_size=16,
              kv_cache_memory=2**20, **kw)
    return ModelRunner(EngineConfig(model=str(path), **kw))


@torch.no_grad()
def _steps(runner) -> list[torch.Tensor]:
    """Logits of every row of three steps: a packed prefill (the last prompt chunked), its
    chunk's rest beside decodes of the others, a pure decode of all four."""
    bm = BlockManager(runner.num_blocks, runner.page_size, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence(torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                     SamplingParams(temperature=0)) for n in (13, 1, 21, 21)]
    steps = [list(zip(seqs, (13, 1, 21, 10))),
             [(s, 1) for s in seqs[:3]] + [(seqs[3], 11)],
             [(s, 1) for s in seqs]]
    for s in seqs:
        assert bm.allocate(s)
    out = []
    for i, scheduled in enumerate(steps):
        if i:  # fixed tokens, not sampled ones: every process must feed the same
            for s, n in scheduled:
                if n == 1:
                    s.append_token(5 + i)
            for s, n in scheduled:
                assert bm.ensure_slots(s, n)
        inputs = runner.prepare(scheduled)
        assert inputs.meta.is_decode == (i == 2)
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        out.append(runner.model.compute_logits(hidden))
        for s, n in scheduled:
            s.num_computed_tokens += n
    return out


@torch.no_grad()
def _biased_layers() -> dict:
    """A column-parallel linear with a bias, its output slices gathered, then fed to a
    row-parallel one with a bias (added once, after the all_reduce); (ours, reference)
    pairs. No supported model has these biases, so they are checked here."""
    tp = ParallelGroup.for_size(WORLD)
    g = torch.Generator().manual_seed(2)
    x, wc, bc, wr, br = (torch.randn(shape, generator=g)
                         for shape in ((5, 8), (10, 8), (10,), (8, 10), (8,)))
    col, row = ColumnParallelLinear(8, [10], bias=True, tp=tp), \
        RowParallelLinear(10, 8, bias=True, tp=tp)
    for layer, weight, bias in ((col, wc, bc), (row, wr, br)):
        layer.load_weight("weight", weight)
        layer.load_weight("bias", bias)
    hidden = torch.nn.functional.linear(x, wc, bc)
    return {"column": (tp.all_gather(col(x)), hidden),
            "row": (row(col(x)), torch.nn.functional.linear(hidden, wr, br))}


def _tp_rank(rank, world, specs):
    """{"layers": _biased_layers(), case: logits of _steps} on this rank."""
    results = {"layers": _biased_layers()}
    for name, path, kw in specs:
        runner = _runner(path, tensor_parallel_size=world, **kw)
        assert runner.kv_cache.shape[-2] == \
            runner.config.model_config.num_key_value_heads // world  # this rank's heads
        results[name] = _steps(runner)
    return results


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """{case: checkpoint dir}, and each rank's {case: logits of each step}: every case in
    one spawn of the two processes (starting them is most of the time)."""
    paths, specs = {}, []
    for name, (case, overrides, kw) in CASES.items():
        path = paths[name] = tmp_path_factory.mktemp(name)
        if kw.get("load_format") == "dummy":
            hf_config(case, **overrides).save_pretrained(path)  # config.json, no weights
        else:
            make_checkpoint(path, case, **overrides)
        specs.append((name, str(path), kw))
    return paths, run_gloo(_tp_rank, WORLD, tmp_path_factory.mktemp("ranks"), specs,
                           timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_logits_equal_one_process(tp_run, name):
    paths, ranks = tp_run
    want = _steps(_runner(paths[name], **CASES[name][2]))
    for rank, results in enumerate(ranks):
        for step, (got, ref) in enumerate(zip(results[name], want, strict=True)):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank} step {step}: {m}")
    for a, b in zip(*(r[name] for r in ranks)):
        assert torch.equal(a, b)  # all-gathered: the same logits on every rank


def test_tp2_biased_linears(tp_run):
    for rank, results in enumerate(tp_run[1]):
        for name, (got, want) in results["layers"].items():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def test_heads_must_split_evenly():
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a divisor of the "
                       "model's num_key_value_heads 2, got 4. Replicating kv heads"):
        QKVParallelLinear(64, 4, 2, 16, tp=ParallelGroup(rank=0, size=4))
    with pytest.raises(ValueError, match="num_attention_heads 6, got 4"):
        QKVParallelLinear(64, 6, 2, 16, tp=ParallelGroup(rank=0, size=4))
    config = ModelConfig.from_dict(hf_config("llama", intermediate_size=91).to_dict())
    with pytest.raises(ValueError, match="a divisor of intermediate_size 91, got 2"), \
            torch.device("meta"):
        CausalLM(config, 64, tp=ParallelGroup(rank=1, size=2))


def test_model_runner_needs_a_process_group(tmp_path):
    """A ModelRunner of rank r is built inside an initialised group (LLM starts one)."""
    hf_config("llama").save_pretrained(tmp_path)
    assert group_size() == 1 and ParallelGroup.for_size(1) == SINGLE
    config = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, device="cpu",
                          load_format="dummy", max_model_len=64)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected the size of an "
                       "initialised torch.distributed group, got 2 with 1 process"):
        ModelRunner(config)


def test_tensor_parallel_size_is_checked(tmp_path, monkeypatch):
    hf_config("llama", intermediate_size=90).save_pretrained(tmp_path)  # 4 / 2 heads

    def config(**kw):
        return EngineConfig(model=str(tmp_path), **kw)

    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"tensor_parallel_size: expected an int >= 1, "
                           f"got {bad!r}"):
            config(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a divisor of the "
                       "model's num_attention_heads 4, got 3"):
        config(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads 2, got 4"):
        config(tensor_parallel_size=4)
    with pytest.raises(ValueError, match="a divisor of intermediate_size 90, got 4"):
        hf_config("llama", num_key_value_heads=4, intermediate_size=90).save_pretrained(
            tmp_path)
        config(tensor_parallel_size=4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected at most the 1 "
                       "visible CUDA devices, got 2"):
        config(tensor_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match="device: expected 'auto' or 'cuda' with "
                       "tensor_parallel_size > 1 .* got 'cuda:1'. Choose the GPUs with "
                       "CUDA_VISIBLE_DEVICES"):
        config(tensor_parallel_size=2, device="cuda:1")
    assert config(tensor_parallel_size=2, device="cpu").tensor_parallel_size == 2


def test_world_of_one_runs_no_collective(tmp_path, monkeypatch):
    """Under an initialised group of one process, tensor_parallel_size=1 builds the
    single-process model; a size that is not the group's is refused."""
    hf_config("qwen2-bias").save_pretrained(tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert group_size() == 1
        with pytest.raises(ValueError, match="got 2 with 1 process"):
            ParallelGroup.for_size(2)
        monkeypatch.setattr(dist, "all_reduce", None)  # any collective call would fail
        monkeypatch.setattr(dist, "all_gather", None)
        runner = _runner(tmp_path, load_format="dummy")
        assert runner.model.tp == SINGLE
        assert len(_steps(runner)) == 3
        with pytest.raises(RuntimeError, match="LLM\\(tensor_parallel_size > 1\\) starts "
                           "its own process group, but torch.distributed is already"):
            LLM(str(tmp_path), tensor_parallel_size=2, load_format="dummy", **LLM_KW)
    finally:
        dist.destroy_process_group()


# ---- the driver: LLM(tensor_parallel_size=2) --------------------------------------------
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
    params = [greedy] * 5 + [seeded]
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
            runs[llm] = [o.outputs[0] for _ in range(2)
                         for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        two.shutdown()
    _no_engine_left(shm)
    assert max(cached) == 32
    assert max(_MeasuredChannel.sizes) > 2 * capacity or capacity == CAPACITY
    for want, got in zip(runs[one], runs[two], strict=True):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(o.token_ids) for o in runs[two]}) > 3


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
def test_dead_worker_raises_in_rank_0(tmp_path):
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
