"""Per-call time of a CUDA step run in a loop, for the host-cost studies in this folder."""
import cProfile
import pstats
import time

import torch


def loop_us(fn, n=300, warmup=20) -> tuple[float, float]:
    """(host, wall) microseconds per call of ``fn`` over n calls after warm-up: host up
    to the last call's return, wall until the device has finished them all. A step whose
    host time is near its wall time is launch-bound."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / n * 1e6


def print_profile(fn, n, lines):
    """cProfile of n calls of ``fn``, the top ``lines`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(lines)
