"""``python -m flashtile demo`` (``make demo``): what flashtile is for, in about a minute.

1. Check: flashtile's forward and backward on a few shapes against float64 attention
   (fp32 on CUDA), each error within 2x PyTorch's own error at that dtype plus a floor
   (reference.error_bound). The command exits 1 if any is over.
2. Memory: forward + backward at growing sequence lengths beside naive attention
   (PyTorch's SDPA math backend, which forms the seqlen x seqlen score matrix):
   flashtile's extra memory grows linearly with seqlen, naive's quadratically.

On the best device here: CUDA if present, else CPU. ``flashtile bench`` is the full
comparison with PyTorch's SDPA backends.
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import flashtile
from flashtile._backend import backend_name, default_device, resolve_device
from flashtile.bench import commands as bench_commands
from flashtile.bench.run import peak_extra_mib
from flashtile.reference import attention_naive, error_bound, max_abs_error, sdpa_math_bshd


@dataclass(frozen=True)
class Shape:
    """One check case: q, k, v are (batch, seqlen, nheads, head_dim), all one dtype."""

    batch: int
    nheads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.float32

    def label(self) -> str:
        return f"{self.batch}x{self.nheads}x{self.seqlen}x{self.head_dim}"


def _grid(batch_seqlens, head_dims, nheads, dtype):
    return [Shape(b, nheads, s, d, causal, dtype) for b, s in batch_seqlens
            for d in head_dims for causal in (False, True)]


# Odd lengths and head dims, so the last tiles are partial.
CPU_SHAPES = _grid([(2, 127), (1, 1000)], [64, 40], nheads=4, dtype=torch.float32)
CUDA_SHAPES = _grid([(4, 1000), (1, 2049)], [64, 128], nheads=16, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Scaling:
    """The memory part: forward + backward of (batch, seqlen, nheads, head_dim) inputs,
    non-causal, at each of ``seqlens``."""

    seqlens: tuple
    batch: int
    nheads: int
    head_dim: int
    dtype: torch.dtype

    def shape(self, seqlen) -> Shape:
        return Shape(self.batch, self.nheads, seqlen, self.head_dim, False, self.dtype)


# CPU: about 30 s on 2 cores for both paths; naive holds ~3 (B, H, S, S) matrices, about
# 1.5 GiB at 8192. CUDA: at 65536 naive would need ~128 GiB per score matrix.
CPU_SCALING = Scaling((2048, 4096, 8192), batch=1, nheads=2, head_dim=64,
                      dtype=torch.float32)
CUDA_SCALING = Scaling((4096, 16384, 65536), batch=1, nheads=16, head_dim=128,
                       dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------
# 1. Check

@dataclass
class Row:
    """One line of the check table. Errors are max |x - reference| over all elements."""

    shape: Shape
    backend: str
    out_err: float
    dq_err: float
    out_tol: float
    dq_tol: float

    @property
    def ok(self) -> bool:
        return self.out_err <= self.out_tol and self.dq_err <= self.dq_tol


def _forward_backward(attn, q, k, v, dout):
    """out and dq of one forward + backward (dk, dv computed too, then dropped)."""
    out = attn(q, k, v)
    dq, _, _ = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq


def _inputs(s: Shape, device):
    """q, k, v (requiring grad) and dout, drawn on ``device`` (the longest CUDA inputs
    have 134M elements each: slow to draw on the host and copy over)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(s.batch, s.seqlen, s.nheads, s.head_dim, generator=gen,
                                 device=device, dtype=s.dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def check_shape(s: Shape, device) -> Row:
    """flashtile's out and dq against naive attention in float64 (CPU) or fp32 (CUDA);
    the tolerance is 2x PyTorch's SDPA math error at s.dtype plus a floor."""
    q, k, v, dout = _inputs(s, device)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    ref_out, ref_dq = _forward_backward(
        lambda *x: attention_naive(*x, causal=s.causal, upcast=False)[0],
        *(x.detach().to(ref_dtype).requires_grad_() for x in (q, k, v)), dout.to(ref_dtype))
    out, dq = _forward_backward(
        lambda *x: flashtile.flash_attn_func(*x, causal=s.causal), q, k, v, dout)
    torch_out, torch_dq = _forward_backward(sdpa_math_bshd(s.causal), q, k, v, dout)
    return Row(s, backend_name(device), max_abs_error(out, ref_out),
               max_abs_error(dq, ref_dq),
               error_bound(max_abs_error(torch_out, ref_out), ref_out, s.dtype),
               error_bound(max_abs_error(torch_dq, ref_dq), ref_dq, s.dtype))


def run_check(shapes=None, device=None, progress=None) -> list[Row]:
    """``check_shape`` of each shape; default ``CUDA_SHAPES`` on CUDA, ``CPU_SHAPES`` on
    CPU. ``progress``: optional callable given each ``Row`` as it is done."""
    device = torch.device(device) if device is not None else default_device()
    if shapes is None:
        shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    rows = []
    for s in shapes:
        rows.append(check_shape(s, device))
        if progress is not None:
            progress(rows[-1])
    return rows


CHECK_HEADER = ("| shape BxHxSxD | dtype | causal | out err (tol) | dq err (tol) | ok |\n"
                "|---|---|---|---:|---:|---|")


def format_row(r: Row) -> str:
    s = r.shape
    return (f"| {s.label()} | {str(s.dtype).replace('torch.', '')} | {s.causal} "
            f"| {r.out_err:.1e} ({r.out_tol:.0e}) | {r.dq_err:.1e} ({r.dq_tol:.0e}) "
            f"| {'yes' if r.ok else 'NO'} |")


# ---------------------------------------------------------------------------------------
# 2. Memory and time against seqlen

@dataclass
class Point:
    """One path at one length: median time, peak memory above the inputs (None where it
    cannot be measured), or why it did not run."""

    ms: float | None = None
    mib: float | None = None
    skipped: str | None = None


def _cpu_call(fn):
    """(ms, MiB) of one call of ``fn``: its wall time and, on Linux, how far the
    process's peak resident memory rose above the memory in use before it (MiB is None
    elsewhere). Freed C-heap memory is first handed back (malloc_trim) and the kernel's
    peak counter reset to the current size (clear_refs "5"), so memory left over from an
    earlier call neither hides nor inflates this one's."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    except (OSError, AttributeError, TypeError):  # not Linux with glibc: time only
        before = None
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return ms, None if before is None else (_status_kib("VmHWM") - before) / 1024


def _status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _naive_need_bytes(s: Shape) -> int:
    """SDPA math's forward + backward peak: about 3.5 (B, H, S, S) matrices of s.dtype
    (measured on CPU in fp32), rounded up to 4."""
    return 4 * s.batch * s.nheads * s.seqlen**2 * torch.finfo(s.dtype).bits // 8


def _size(nbytes) -> str:
    return f"{nbytes / 2**30:.0f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _free_bytes(device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume it fits
        return None


def measure(attn, s: Shape, device, repeats: int) -> Point:
    """Median time of ``repeats`` forward + backward calls and the peak memory above the
    inputs: CUDA, after a warm-up call, with CUDA events and max_memory_allocated; CPU,
    with no warm-up of its own (the check ran both paths), the largest rise of one call."""
    q, k, v, dout = _inputs(s, device)
    step = lambda: _forward_backward(attn, q, k, v, dout)  # noqa: E731
    if device.type == "cuda":
        step()
        times = []
        for _ in range(repeats):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        return Point(statistics.median(times), peak_extra_mib(step, device))
    calls = [_cpu_call(step) for _ in range(repeats)]
    mibs = [mib for _, mib in calls if mib is not None]
    return Point(statistics.median(ms for ms, _ in calls), max(mibs) if mibs else None)


def run_scaling(scaling=None, device=None, repeats: int = 1, progress=None):
    """[(seqlen, flashtile Point, naive Point)] for each length of ``scaling`` (default
    ``CUDA_SCALING`` on CUDA, ``CPU_SCALING`` on CPU). Naive is skipped where its score
    matrices would need more than half the free memory."""
    device = torch.device(device) if device is not None else default_device()
    if scaling is None:
        scaling = CUDA_SCALING if device.type == "cuda" else CPU_SCALING
    if repeats < 1:
        raise ValueError(f"repeats: expected an int >= 1, got {repeats}")
    points = []
    for seqlen in scaling.seqlens:
        s = scaling.shape(seqlen)
        flash = measure(lambda *x: flashtile.flash_attn_func(*x), s, device, repeats)
        need, free = _naive_need_bytes(s), _free_bytes(device)
        if free is not None and need > free // 2:
            naive = Point(skipped=f"needs ~{_size(need)}")
        else:
            naive = measure(sdpa_math_bshd(False), s, device, repeats)
        points.append((seqlen, flash, naive))
        if progress is not None:
            progress(points[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return points


SCALING_HEADER = ("| seqlen | flashtile MiB | naive MiB | flashtile ms | naive ms |\n"
                  "|---:|---:|---:|---:|---:|")


def _num(x, spec):
    return "n/a" if x is None else format(x, spec)


def format_point(seqlen, flash: Point, naive: Point) -> str:
    naive_cells = ((naive.skipped, "skipped") if naive.skipped else
                   (_num(naive.mib, ".0f"), _num(naive.ms, ".0f")))
    return (f"| {seqlen} | {_num(flash.mib, '.0f')} | {naive_cells[0]} "
            f"| {_num(flash.ms, '.0f')} | {naive_cells[1]} |")


def growth(points) -> str:
    """How the memory grew between the last two lengths where both paths were
    measured: the demo's point in one line, from the numbers above it."""
    both = [(n, f.mib, g.mib) for n, f, g in points if f.mib and g.mib]
    if len(both) < 2:
        return ""
    (n0, f0, g0), (n1, f1, g1) = both[-2:]
    return (f"From seqlen {n0} to {n1} (x{n1 / n0:g}) flashtile's memory grew "
            f"x{f1 / f0:.1f}, naive attention's x{g1 / g0:.1f}: at {n1} flashtile needs "
            f"{f1:.0f} MiB, naive {g1:.0f} MiB.")


# ---------------------------------------------------------------------------------------
# The command

def _demo(args) -> int:
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"flashtile {flashtile.__version__} demo on {name}, torch {torch.__version__}, "
          f"backend {backend_name(device)}\n", flush=True)
    ref = "float64" if device.type == "cpu" else "fp32"
    print(f"1. Correct: forward and backward against attention computed in {ref}\n")
    print(CHECK_HEADER, flush=True)
    rows = run_check(device=device, progress=lambda r: print(format_row(r), flush=True))
    print("\nErrors: max |x - ref| of out and dq; tol = 2 x the error of PyTorch's own "
          "attention (SDPA math) at the same dtype + a floor.")
    bad = [r.shape.label() for r in rows if not r.ok]
    if bad:
        print(f"\nFAILED: error over tolerance for {', '.join(bad)}", file=sys.stderr)
        return 1

    scaling = CUDA_SCALING if device.type == "cuda" else CPU_SCALING
    dtype = str(scaling.dtype).replace("torch.", "")
    print(f"\n2. Memory linear in seqlen: forward + backward, batch {scaling.batch}, "
          f"{scaling.nheads} heads, head_dim {scaling.head_dim}, {dtype}, beside naive "
          "attention (PyTorch's SDPA math backend, which forms the seqlen x seqlen "
          "score matrix)\n")
    print(SCALING_HEADER, flush=True)
    repeats = args.repeats or (10 if device.type == "cuda" else 1)
    points = run_scaling(scaling, device, repeats,
                         progress=lambda p: print(format_point(*p), flush=True))
    if device.type == "cuda":
        how = "peak torch.cuda.max_memory_allocated above the inputs"
    elif any(f.mib is not None for _, f, _ in points):
        how = "the rise of the process's peak resident memory (VmHWM) during the call"
    else:
        how = "not measured on this system (Linux only)"
    calls = "one call" if repeats == 1 else f"median of {repeats} calls"
    print(f"\nMemory: {how}. Time: {calls}.\n")
    print(f"OK: all {len(rows)} checks within tolerance.")
    if growth(points):
        print(growth(points))
    print("\nNext: `make bench` (python -m flashtile bench) compares flashtile with "
          "PyTorch's SDPA backends over a sweep of shapes, with tables and plots "
          "(minutes on a CPU); docs/benchmarks/ has the GPU results.")
    return 0


def add_demo(commands):
    p = commands.add_parser("demo", help="a one-minute tour: correctness against float64, "
                            "then memory and time beside naive attention")
    bench_commands.add_device(p)
    p.add_argument("--repeats", type=bench_commands.positive_int,
                   help="timed calls per path and length (median); default 1 on CPU, "
                   "10 on CUDA")
    p.set_defaults(handler=_demo)
