"""Tensor parallelism (engine/parallel.py): the model split over 2 processes (gloo on CPU,
the same code NCCL runs on GPUs) computes the logits of the whole model in one process.

Each rank builds a ModelRunner at tensor_parallel_size=2 over a random-initialised
transformers checkpoint (GQA, qkv bias, tied embeddings over a vocabulary that does not
split evenly, Qwen3's q/k norms in a sharded checkpoint) or dummy weights, and runs a
packed prefill with a chunked prompt, a step mixing decodes with the chunk's rest (paged
prefill), and a pure decode step over its half of the KV pool. Every rank's logits must
equal the single-process model's (fp32, 1e-5). The checks of tensor_parallel_size are
here; LLM's multi-process driver is tested in test_engine_tp_driver.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flashtile.engine import LLM
from flashtile.engine.block_manager import BlockManager
from flashtile.engine.config import EngineConfig, ModelConfig
from flashtile.engine.model import CausalLM
from flashtile.engine.parallel import SINGLE, ColumnParallelLinear, ParallelGroup, \
    QKVParallelLinear, RowParallelLinear, group_size
from flashtile.engine.runner import ModelRunner
from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.sequence import Sequence
from tests.engine_utils import VOCAB, engine_cpu, hf_config, make_checkpoint
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
    # Each rank's half of an FP8 pool (fp16 model).
    "llama-gqa-fp8kv": ("llama", {}, dict(dtype="float16", kv_cache_dtype="fp8")),
}
# fp16 cases: the all-reduce sums in another order than one process does, and where a
# key moved by an fp16 ulp sits at an FP8 rounding boundary its pool entry moves by an
# FP8 step (as in test_engine_model's FP8 case): measured 0.024 of logits up to ~2.6.
ATOL = {"llama-gqa-fp8kv": 5e-2}


def _runner(path, **kw):
    kw = {**dict(dtype="float32", device="cpu", max_model_len=64, page_size=16,
                 kv_cache_memory=2**20), **kw}
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
            tol = ATOL.get(name, 1e-5)
            torch.testing.assert_close(got.float(), ref.float(), atol=tol,
                                       rtol=1e-5 if tol == 1e-5 else 0,
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
            LLM(str(tmp_path), tensor_parallel_size=2, load_format="dummy", device="cpu")
    finally:
        dist.destroy_process_group()
