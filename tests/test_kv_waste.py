"""flashtile bench kv-waste: the engine's scheduler and block manager over a workload,
waste of the paged pool against contiguous max_model_len slabs."""

import pytest

from flashtile.bench.kv_waste import simulate
from flashtile.bench.throughput import workload


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_waste_is_at_most_a_partial_page_per_sequence(page_size):
    requests = workload(40, 30, 200, vocab_size=1000, seed=1)
    r = simulate(requests, page_size, max_model_len=512, pool_tokens=40 * 512,
                 max_num_batched_tokens=1024)
    # Each sequence holds at most page_size - 1 unused slots; every live sequence has at
    # least min_len = 30 tokens, so the waste is below (page_size - 1) / (30 + page - 1).
    assert 0 < r["paged_waste"] < (page_size - 1) / (30 + page_size - 1)
    assert r["slab_waste"] > 0.5  # lengths <= 400 of 512 reserved, ~half on average
    assert r["preemptions"] == 0 and r["peak_running"] == 40


def test_a_small_pool_holds_more_sequences_paged_than_as_slabs():
    requests = workload(40, 30, 200, vocab_size=1000, seed=2)
    r = simulate(requests, 16, max_model_len=512, pool_tokens=8 * 512,
                 max_num_batched_tokens=1024)
    assert r["slab_capacity"] == 8
    assert r["peak_running"] > 2 * r["slab_capacity"]  # same memory, paged


def test_a_pool_smaller_than_one_sequence_is_an_error():
    with pytest.raises(RuntimeError, match="cannot hold one sequence"):
        simulate([([1] * 100, 10)], 16, max_model_len=512, pool_tokens=64)


def test_cli_dispatch(capsys):
    from flashtile.cli import main
    assert main(["bench", "kv-waste", "--num-requests", "8", "--page-sizes", "16",
                 "--max-len", "200", "--max-model-len", "512"]) == 0
    assert "| 16 |" in capsys.readouterr().out
