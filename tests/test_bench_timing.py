"""The CPU bench timer starts only after a warm-up by time (issue 13: a sweep's first
cells were timed inside the process's cold start, 5-9x slower than a second run)."""

import time

from flashtile.bench import run


def test_cpu_timing_starts_after_the_warm_up(monkeypatch):
    monkeypatch.setattr(run, "_cpu_warm", set())
    monkeypatch.setattr(run, "CPU_WARMUP_S", (0.3, 0.02))
    start = time.perf_counter()

    def cold_then_warm():  # 20 ms a call for the first 0.2 s, then 1 ms
        time.sleep(0.02 if time.perf_counter() - start < 0.2 else 0.001)

    median, _, _ = run.time_step(cold_then_warm, "cpu", repeats=5)
    assert median < 10
    calls = []  # a later cell: the short warm-up, still CPU_WARMUP_CALLS calls at least
    run.time_step(lambda: calls.append(1), "cpu", repeats=3)
    assert len(calls) >= run.CPU_WARMUP_CALLS + 3
