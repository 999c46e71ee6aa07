"""flashtile bench serve: vLLM's serving metrics from synthetic timestamps against
hand-computed values; arrivals and the random workload; an end-to-end run against
flashtile serve on a tiny checkpoint (CPU); `flashtile bench serve|throughput` dispatch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from flashtile.bench.serve import (RequestResult, arrival_times, compute_metrics,
                                   peak_concurrency, percentile, random_requests)
from flashtile.cli import main
from tests.engine_utils import VOCAB, ServerThread, engine_cpu, tiny_llm

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
pytestmark = pytest.mark.timeout(120)


def _result(prompt_len, output_len, start, ttft, itl, latency, success=True):
    return RequestResult(prompt_len=prompt_len, output_len=output_len, success=success,
                         start=start, ttft=ttft, itl=itl, latency=latency)


def test_metrics_equal_hand_computed_values():
    results = [
        _result(10, 4, start=0.0, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        _result(20, 1, start=0.05, ttft=0.3, itl=[], latency=0.3),  # no TPOT
        _result(30, 3, start=0.1, ttft=1.2, itl=[0.1, 0.1], latency=1.4),
        _result(40, 0, start=0.2, ttft=0, itl=[], latency=0, success=False),
    ]
    m = compute_metrics(results, duration=2.0, slo_ttft_ms=1000, slo_tpot_ms=50)
    want = {
        "completed": 3, "failed": 1, "total_input_tokens": 60, "total_output_tokens": 8,
        "request_throughput": 1.5, "output_throughput": 4.0, "total_token_throughput": 34.0,
        # TTFT 100, 300, 1200 ms; p90 at rank 1.8: 300 + 0.8 * 900.
        "mean_ttft_ms": 1600 / 3, "median_ttft_ms": 300, "p90_ttft_ms": 1020,
        "p99_ttft_ms": 1182,
        # TPOT (200 - 100) / 3 and (1400 - 1200) / 2 ms; the 1-token request has none.
        "mean_tpot_ms": 200 / 3, "median_tpot_ms": 200 / 3,
        "p90_tpot_ms": 100 / 3 + 0.9 * 200 / 3, "p99_tpot_ms": 100 / 3 + 0.99 * 200 / 3,
        # ITL pooled: 20, 30, 50, 100, 100 ms.
        "mean_itl_ms": 60, "median_itl_ms": 50, "p90_itl_ms": 100, "p99_itl_ms": 100,
        "mean_e2el_ms": 1900 / 3, "median_e2el_ms": 300, "p90_e2el_ms": 1180,
        "p99_e2el_ms": 1378,
        # Good: the first (TTFT 100, TPOT 33) and the 1-token one (TPOT counts as 0);
        # the third misses the TTFT SLO.
        "request_goodput": 1.0,
        "max_concurrent_requests": 3,  # all three in flight at t = 0.1
    }
    assert {k: m[k] for k in want} == pytest.approx(want, rel=1e-9)
    assert compute_metrics(results, 2.0, slo_ttft_ms=2000, slo_tpot_ms=120)[
        "request_goodput"] == 1.5
    empty = compute_metrics(results[3:], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] == 0 == empty["p99_itl_ms"]


def test_percentile_is_numpys_and_concurrency_is_half_open():
    xs = np.random.default_rng(0).exponential(size=37).tolist()
    for p in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p), rel=1e-12)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) == 0.0
    back_to_back = [_result(1, 2, start=0, ttft=0, itl=[], latency=1),
                    _result(1, 2, start=1, ttft=0, itl=[], latency=1)]
    assert peak_concurrency(back_to_back) == 1
    assert peak_concurrency(back_to_back + [_result(1, 2, 0.5, 0, [], 1)]) == 2


def test_arrivals_and_random_workload():
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5)):  # Gamma(k): gap CV = 1 / sqrt(k)
        times = arrival_times(4000, 8.0, burstiness, seed=1)
        assert times == arrival_times(4000, 8.0, burstiness, seed=1)
        assert times[-1] == pytest.approx(4000 / 8.0) and times == sorted(times)
        gaps = np.diff([0.0] + times)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert arrival_times(50, 8.0, 1.0, seed=1) != arrival_times(50, 8.0, 1.0, seed=2)
    assert arrival_times(4, 8.0, math.inf, seed=1) == pytest.approx([0.125, 0.25, 0.375, 0.5])

    reqs = random_requests(200, 100, 20, 0.5, vocab_size=VOCAB, seed=3)
    assert reqs == random_requests(200, 100, 20, 0.5, vocab_size=VOCAB, seed=3)
    assert {len(p) for p, _ in reqs} <= set(range(50, 151))
    assert {n for _, n in reqs} <= set(range(10, 31))
    assert all(0 <= t < VOCAB for p, _ in reqs for t in p)
    assert len({len(p) for p, _ in reqs}) > 50  # lengths spread over the range
    exact = random_requests(3, 7, 5, 0.0, vocab_size=VOCAB, seed=0)
    assert [(len(p), n) for p, n in exact] == [(7, 5)] * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for llm in tiny_llm(tmp_path_factory):
        with ServerThread.over(llm, "tiny") as s:
            yield s


def test_end_to_end_against_flashtile_serve(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--base-url", server.url, "--num-prompts", "6",
            "--random-input-len", "8", "--random-output-len", "5",
            "--random-range-ratio", "0.5", "--seed", "4", "--no-progress", "--out", str(out)]
    assert main(args + ["--request-rate", "40"]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["command"].startswith("flashtile bench serve")
    (run,) = report["runs"]
    m = run["metrics"]
    assert (m["completed"], m["failed"], run["errors"]) == (6, 0, [])
    want = random_requests(6, 8, 5, 0.5, VOCAB, seed=4)  # what the client sent
    rows = run["requests"]
    assert [(r["prompt_len"], r["output_len"]) for r in rows] == [(len(p), n) for p, n in want]
    assert m["total_output_tokens"] == sum(n for _, n in want)
    assert all(0 < r["ttft_ms"] <= r["e2el_ms"] for r in rows)
    assert 1 <= m["max_concurrent_requests"] <= 6 and m["request_throughput"] > 0
    printed = capsys.readouterr().out
    assert "| TTFT |" in printed and "| output token throughput |" in printed

    assert main(args + ["--sweep-rates", "50", "inf"]) == 0
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [50, "inf"]
    assert all(r["metrics"]["completed"] == 6 for r in report["runs"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| rate req/s |") and table[2].startswith("| 50 |")
    assert table[3].startswith("| inf |")
    assert (tmp_path / "serve.md").read_text().count("\n| ") == 4  # header, rule, 2 rates
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_streamed_chunks_are_tokens(server):
    """ITL has one gap per token after the first: the server streams a chunk a token."""
    import asyncio

    import aiohttp

    from flashtile.bench.serve import send_request

    async def go():
        async with aiohttp.ClientSession() as session:
            return await send_request(session, server.url + "/v1/completions", "tiny",
                                      [5, 6, 7], 9)

    r = asyncio.run(asyncio.wait_for(go(), 60))
    assert r.success and r.output_len == 9 and len(r.itl) == 8
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))


def test_fake_server_reports_the_host_cost(tmp_path, capsys):
    """--fake-server: flashtile serve over a model-less engine in a child process; the
    report adds its CPU per token, its steps and the tokens they made (all of the run's
    output tokens, none of the check request's), and the profiles when asked."""
    out, profile = tmp_path / "fake.json", tmp_path / "prof"
    assert main(["bench", "serve", "--fake-server", "1", "--num-prompts", "8",
                 "--random-input-len", "16", "--random-output-len", "6", "--no-progress",
                 "--fake-server-profile", str(profile), "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    m, host = run["metrics"], run["metrics"]["server"]
    assert m["completed"] == 8 and host["tokens"] == m["total_output_tokens"] == 48
    assert host["steps"] >= 6 and host["step_ms"] == 1
    assert host["cpu_us_per_token"] >= host["loop_cpu_us_per_token"] > 0
    assert host["engine_cpu_us_per_token"] > 0 and host["device_idle_ms_per_step"] >= 0
    assert "| server CPU per output token" in capsys.readouterr().out
    per_thread = {"loop.prof", "engine.prof"} if sys.version_info < (3, 12) else {"server.prof"}
    assert {p.name for p in profile.iterdir()} == per_thread


def test_bad_server_or_arguments(server, tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1",
                 "--out", str(tmp_path / "x.json")]) == 1
    assert "flashtile bench serve:" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", server.url + "/v1", "--num-prompts", "1",
                 "--out", str(tmp_path / "x.json")]) == 1
    assert "expected an OpenAI-compatible server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--request-rate", "0"])
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--random-range-ratio", "1"])


def test_lengths_beyond_max_model_len_are_refused(server, tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", server.url, "--random-input-len", "60",
                 "--random-output-len", "10", "--out", str(tmp_path / "x.json")]) == 1
    assert "max_model_len=64" in capsys.readouterr().err


def test_cli_dispatches_bench_throughput(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "throughput", "--help"])
    assert exit_.value.code == 0 and "flashtile bench throughput" in capsys.readouterr().out
    # Its options reach it, and through it the provider subprocesses.
    commands = []

    def fake_run(cmd, **kw):
        commands.append(cmd)
        raise subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    argv = ["--models", "qwen2.5-0.5b", "--providers", "engine-naive", "engine-sdpa",
            "--num-requests", "2", "--out", str(tmp_path / "t.json")]
    assert main(["bench", "throughput", *argv]) == 0
    assert len(commands) == 2 and all(c[-len(argv):] == argv for c in commands)
    assert json.loads((tmp_path / "t.json").read_text())["argv"] == argv


def test_throughput_compile_hook_prints_the_specialisation(capsys):
    """The hook is called as Triton 3.6's JITFunction._call_hook calls it (keywords only);
    each argument shows its specialisation: D (16-byte divisible) or a constant."""
    from flashtile.bench.throughput_runs import _print_compile
    _print_compile(key="k", repr="_kernel[num_warps=4](Q: ()", fn=None, compile=dict(
        key="k", signature={"Q": "*bf16", "n": "i32", "one": "constexpr", "B": "constexpr"},
        configs=[{(0,): [["tt.divisibility", 16]]}], constants={(2,): 1, (3,): 64},
        device=0), is_manual_warmup=False, already_compiled=False)
    err = capsys.readouterr().err
    assert err.strip() == "compiling (Triton) _kernel[num_warps=4](Q:*bf16:D, n:i32, one=1, B=64)"
