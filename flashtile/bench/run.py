"""The one bench runner: inputs, warm-up, timing, peak memory, and failures as results.

GPU: ``triton.testing.do_bench`` (a warm-up call, then 25 ms of warm-up and 100 ms of
timed calls; it clears L2 before each one) returns the median and p20/p80 of CUDA-event
times, and the calls rotate among ``n_sets`` input sets as well. Peak memory is
``torch.cuda.max_memory_allocated`` during one more call, minus what was allocated
before it (the inputs). CPU: ``time.perf_counter`` around each of ``repeats`` calls
after a warm-up of at least ``CPU_WARMUP_CALLS`` calls and ``CPU_WARMUP_S`` seconds
(longer for the process's first cell); memory is not measured (None).

A provider that raises ``torch.OutOfMemoryError`` gives an "OOM" result, any other
exception (or a device/shape it does not support) "n/a" with the reason, and the sweep
goes on; after a failure on CUDA the allocator's cache is emptied.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from flashtile.bench import registry
from flashtile.bench.registry import Cell


@contextlib.contextmanager
def env_var(name: str, value: str):
    """os.environ[name] = value for the block, then the previous value (or none)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


logger = logging.getLogger("flashtile")
MiB = 2**20


@dataclass
class Result:
    """What one cell gave. status: "ok", "OOM" or "n/a" (then ``reason`` says why)."""

    cell: Cell
    status: str
    reason: str | None = None
    ms: float | None = None  # median of the timed calls
    ms_p20: float | None = None
    ms_p80: float | None = None
    tflops: float | None = None  # cell.flops() / median time
    peak_mib: float | None = None  # extra memory above the inputs; None where not measured

    def to_json(self) -> dict:
        c = self.cell
        return dict(provider=c.provider, head_dim=c.head_dim, causal=c.causal, mode=c.mode,
                    seqlen=c.seqlen, batch=c.batch, nheads=c.nheads,
                    dtype=str(c.dtype).replace("torch.", ""), status=self.status,
                    reason=self.reason, ms=self.ms, ms_p20=self.ms_p20,
                    ms_p80=self.ms_p80, tflops=self.tflops, peak_mib=self.peak_mib)

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        cell = Cell(d["provider"], d["head_dim"], d["causal"], d["mode"], d["seqlen"],
                    d["batch"], d["nheads"], getattr(torch, d["dtype"]))
        return cls(cell, d["status"], d["reason"], d["ms"], d["ms_p20"], d["ms_p80"],
                   d["tflops"], d["peak_mib"])


def make_inputs(cell: Cell, layout: str, device, n_sets: int = 1, seed: int = 0):
    """``n_sets`` tuples (q, k, v, dout), contiguous in ``layout``; every provider gets
    the same values (drawn in (batch, seqlen, nheads, head_dim), then transposed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cell.batch, cell.seqlen, cell.nheads, cell.head_dim)
    sets = []
    for _ in range(n_sets):
        xs = [torch.randn(shape, generator=gen, device=device, dtype=cell.dtype)
              for _ in range(4)]
        if layout == "bhsd":
            xs = [x.transpose(1, 2).contiguous() for x in xs]
        for x in xs[:3]:
            x.requires_grad_(cell.mode == "fwd_bwd")
        sets.append(tuple(xs))
    return sets


def make_step(attn, mode: str, sets):
    """One call of the cell's work, on the next input set each time."""
    rotation = itertools.cycle(sets)
    if mode == "fwd":
        def step():
            q, k, v, _ = next(rotation)
            with torch.no_grad():
                attn(q, k, v)
    else:
        def step():
            q, k, v, dout = next(rotation)
            torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    return step


def _quantile(sorted_xs, p):
    pos = p * (len(sorted_xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


# CPU warm-up: seconds for the first cell a process times, then for every other cell;
# at least CPU_WARMUP_CALLS calls either way.
CPU_WARMUP_S = (1.0, 0.1)
CPU_WARMUP_CALLS = 2
_cpu_warm: set = set()  # non-empty once this process has timed a CPU cell


def time_step(step, device, repeats: int = 5) -> tuple[float, float, float]:
    """(median, p20, p80) of ``step``'s time in ms, after a warm-up."""
    if torch.device(device).type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(step, warmup=25, rep=100,
                                                quantiles=[0.5, 0.2, 0.8],
                                                return_mode="median")
        return med, p20, p80
    # Warm up by time, not by one call: the first calls of a process run while its
    # thread pool, allocator and caches settle, which on the shared 2-core machine took
    # up to ~0.6 s of 20-100x slower calls; one warm-up call left that inside the
    # timing of a sweep's first cells (issue 13). The first cell a process times gets
    # the long warm-up, every cell a short one for its own shape.
    warmup_s = CPU_WARMUP_S[0] if not _cpu_warm else CPU_WARMUP_S[1]
    start, calls = time.perf_counter(), 0
    while calls < CPU_WARMUP_CALLS or time.perf_counter() - start < warmup_s:
        step()
        calls += 1
    _cpu_warm.add(True)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), _quantile(times, 0.2), _quantile(times, 0.8)


def peak_extra_mib(step, device) -> float | None:
    """CUDA: peak allocation during one ``step`` above what was allocated before."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / MiB


def _measure(provider, cell: Cell, device, repeats: int, n_sets: int):
    # Its own frame, so the inputs are freed when it returns or its exception is dropped.
    attn = provider.build(cell, device)
    sets = make_inputs(cell, provider.layout, device, n_sets)
    if provider.prepare is not None:
        sets = [provider.prepare(*s) for s in sets]
    step = make_step(attn, cell.mode, sets)
    ms, p20, p80 = time_step(step, device, repeats)
    return ms, p20, p80, peak_extra_mib(step, device)


def _reason(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")


def run_cell(cell: Cell, device, repeats: int = 5, n_sets: int | None = None) -> Result:
    """Time one cell; never raises for a provider's failure (see the module doc)."""
    device = torch.device(device)
    provider = registry.PROVIDERS[cell.provider]
    skip = provider.skip_reason(cell, device)
    if skip is not None:
        return Result(cell, "n/a", skip)
    if n_sets is None:  # rotating sets only matter where L2 could serve a repeat
        n_sets = 3 if device.type == "cuda" else 1
    failed = None
    try:
        ms, p20, p80, peak = _measure(provider, cell, device, repeats, n_sets)
    except torch.OutOfMemoryError:
        failed = Result(cell, "OOM", "torch.OutOfMemoryError")
    except Exception as err:  # a peer that cannot run this shape: n/a, go on
        failed = Result(cell, "n/a", _reason(err))
    if failed is not None:
        logger.info("flashtile bench: %s: %s", cell.label(), failed.reason)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return failed
    return Result(cell, "ok", None, ms, p20, p80, cell.flops() / ms / 1e9, peak)


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed: run without a bar
        print("(pip install tqdm for a progress bar)", file=sys.stderr)
        return _NoBar()
    return tqdm(total=total, desc="flashtile bench", unit="cell", file=sys.stderr,
                dynamic_ncols=True)


def run_sweep(sweep: registry.Sweep, device, repeats: int = 5, progress: bool = True,
              on_result=None, skip=frozenset()) -> list[Result]:
    """Run every cell of ``sweep`` on ``device`` but those whose (provider, row) is in
    ``skip``; ``on_result(result)`` after each."""
    device = torch.device(device)
    cells = [c for c in sweep.cells() if (c.provider, c.row()) not in skip]
    bar = _progress_bar(len(cells), progress)
    results = []
    try:
        for cell in cells:
            bar.set_postfix_str(cell.label())
            results.append(run_cell(cell, device, repeats))
            if on_result is not None:
                on_result(results[-1])
            bar.update()
    finally:
        bar.close()
    return results
